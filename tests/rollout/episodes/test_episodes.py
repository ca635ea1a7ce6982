"""Multi-turn episodes through the embedded engine, token in and token out, scored by the trainer.

The tokenizer here is one whose decode-then-encode round trip changes tokens: half its ids decode to the
same text as a smaller id, and encoding picks the smaller one (real tokenizers have such aliases: byte
fallback beside merged tokens). A rollout that re-encoded the model's turns would hand the trainer tokens
the model never sampled; this one keeps them as sampled, so the trainer's true_on_policy recompute equals
every model token's log-prob bit for bit across turns.
"""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from contract.environment import EndReason, EpisodeLimits, EpisodeProblem
from kernels.attention import REGISTRY
from recipes.tiny_model import TinyQwen3Config, build_model_dir
from services.rollout.embedded.torch_engine import TorchEngine, TorchEngineConfig
from services.rollout.episodes.runner import ChatTemplateCodec, EpisodeSpec, PlainCodec, SampledTurn, run_episodes
from services.rollout.types import SamplingConfig
from services.trainer.data.batching import TrainSample
from services.trainer.data.wire import StepRequest
from services.trainer.trainer import Trainer
from tests.rollout.hostile_environments import register_feedback, register_hostile

register_feedback()
register_hostile()

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SMALL = TinyQwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=128, initializer_range=0.2)
TEMPERATURE = 0.9
LIMITS = EpisodeLimits(max_turns=3, max_episode_tokens=200, step_timeout_s=5.0)


class AliasingTokenizer:
    """ids 4.. decode to ALPHABET[(id - 4) % len(ALPHABET)]; encode maps each character to its smallest id."""

    ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 :<>/*"

    def __init__(self, vocab: int):
        self.vocab = vocab

    def decode(self, ids) -> str:
        return "".join(self.ALPHABET[(i - 4) % len(self.ALPHABET)] for i in ids if i >= 4)

    def encode(self, text: str) -> list[int]:
        return [4 + self.ALPHABET.index(c) for c in text]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiny_episodes") / "m", SMALL, seed=5)


@pytest.fixture
def restore_torch_globals():
    """The Trainer's configure_determinism changes process-wide torch settings; put them back."""
    det, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(det)
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def restore_attention_policy():
    saved = REGISTRY.policy
    yield
    REGISTRY.set_policy(saved)


def _specs(n: int) -> list[EpisodeSpec]:
    return [EpisodeSpec(f"g{i // 2}", i % 2, EpisodeProblem(f"p{i}", f"count {i}: ", "x"), seed=31 * i + 7)
            for i in range(n)]


def test_three_turn_episodes_keep_the_sampled_tokens_and_score_with_the_samplers_bits(model_dir,
                                                                                     restore_torch_globals):
    engine = TorchEngine(TorchEngineConfig(dtype="float32", numerics="true_on_policy", max_batch_size=4))
    engine.load(str(model_dir), 0)
    tokenizer = AliasingTokenizer(engine._model.get_input_embeddings().num_embeddings)
    sampled: dict[tuple[int, ...], list[int]] = {}  # each context -> the tokens the engine sampled after it

    def sample(contexts, seeds, sampling, episode_ids):
        turns = engine.sample_turns(contexts, seeds, sampling, episode_ids)
        sampled.update((tuple(c), t.token_ids) for c, t in zip(contexts, turns))
        return turns

    sampling = SamplingConfig(temperature=TEMPERATURE, max_new_tokens=6)
    episodes = run_episodes(_specs(4), environment="test-feedback", options={}, limits=LIMITS,
                            codec=PlainCodec(tokenizer), sample=sample, sampling=sampling)
    for e in episodes:
        assert e.end_reason is EndReason.MAX_TURNS and e.turns == 3 and e.turn_rewards == [0.25] * 3
        assert e.prompt_ids == tokenizer.encode(f"count {e.index + 2 * int(e.group_id[1:])}: ")
        # model turn, observation, model turn, observation, model turn
        runs = [(m, sum(1 for _ in g)) for m, g in itertools.groupby(e.response_mask)]
        assert [m for m, _ in runs] == [True, False, True, False, True]
        assert len(e.logprobs) == sum(e.response_mask)
        observations = [t for t, m in zip(e.response_ids, e.response_mask) if not m]
        assert tokenizer.decode(observations) == " try 1:  try 2: "
    # Each model turn in a trajectory is what the engine sampled after exactly the context before it...
    for e in episodes:
        context, turns = list(e.prompt_ids), 0
        for is_model, run in itertools.groupby(zip(e.response_ids, e.response_mask), key=lambda x: x[1]):
            tokens = [t for t, _ in run]
            if is_model:
                assert sampled[tuple(context)] == tokens
                turns += 1
            context += tokens
        assert turns == 3
    assert len(sampled) == 12
    # ...where a decode-then-encode round trip would have changed some of them.
    assert any(tokenizer.encode(tokenizer.decode(t)) != t for t in sampled.values())

    trainer = Trainer(device="cpu", num_threads=1)
    trainer.configure(run_id="episodes", model_path=str(model_dir), seed=7, config_json=json.dumps({
        "numerics": "true_on_policy", "dtype": "float32", "microbatch_tokens": 4096, "temperature": TEMPERATURE}))
    samples = [TrainSample(e.sample_id, e.group_id, torch.tensor(e.prompt_ids), torch.tensor(e.response_ids),
                           torch.tensor(e.logprobs, dtype=torch.float32), e.reward, 0.5 - (i % 2),
                           torch.tensor(e.response_mask)) for i, e in enumerate(episodes)]
    verdict = trainer.check_parity(StepRequest("episodes", 1, 0, samples))
    assert verdict.passed, verdict.message()
    assert verdict.stats["logprob_abs_diff_max"] == 0.0
    assert verdict.stats["tokens"] == sum(len(e.logprobs) for e in episodes)
    m = trainer.train_step(StepRequest("episodes", 1, 0, samples)).metrics
    assert m["iw_min"] == m["iw_max"] == 1.0 and m["grad_norm"] > 0


def _fixed_sampler(turn_tokens: list[int]):
    def sample(contexts, seeds, sampling, episode_ids):
        return [SampledTurn(turn_tokens[:sampling.max_new_tokens], [-0.5] * min(len(turn_tokens),
                                                                             sampling.max_new_tokens), "stop")
                for _ in contexts]
    return sample


def test_a_failing_environment_ends_only_its_episode_with_its_reason():
    tokenizer = AliasingTokenizer(64)
    fine, hostile = tokenizer.encode("fine"), tokenizer.encode("boom")
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    for name, reason in [("test-raises", EndReason.ENV_ERROR), ("test-hangs", EndReason.ENV_TIMEOUT),
                         ("test-huge", EndReason.OBSERVATION_TOO_LARGE),
                         ("test-not-utf8", EndReason.OBSERVATION_NOT_UTF8), ("test-dies", EndReason.ENV_CRASHED),
                         ("test-never-done", EndReason.MAX_TURNS), ("test-hangs-in-reset", EndReason.ENV_TIMEOUT)]:
        # Only the hanging environments wait out the step timeout; the others get one a loaded CI host never
        # reaches (a 0.5 s one was: "test-huge" timed out there instead of being refused for its size).
        timeout_s = 0.5 if reason is EndReason.ENV_TIMEOUT else 60.0
        limits = EpisodeLimits(max_turns=3, max_episode_tokens=200, step_timeout_s=timeout_s,
                               max_observation_bytes=1024)
        episodes = run_episodes(_specs(1), environment=name, options={}, limits=limits, codec=PlainCodec(tokenizer),
                                sample=_fixed_sampler(hostile), sampling=sampling)
        assert episodes[0].end_reason is reason, (name, episodes[0].end_message)
        if name == "test-hangs-in-reset":
            assert not episodes[0].trainable
        else:
            assert episodes[0].trainable and episodes[0].response_mask[:4] == [True] * 4
    # A well-behaved turn first, then the failure: the episode keeps what came before.
    episodes = run_episodes(_specs(1), environment="test-raises", options={}, limits=limits,
                            codec=PlainCodec(tokenizer), sample=_fixed_sampler(fine), sampling=sampling)
    assert episodes[0].end_reason is EndReason.MAX_TURNS  # "fine" every turn: never misbehaves


def test_the_episode_token_budget_cuts_the_turn_that_reaches_it():
    tokenizer = AliasingTokenizer(64)
    limits = EpisodeLimits(max_turns=5, max_episode_tokens=20)
    episodes = run_episodes(_specs(1), environment="test-feedback", options={}, limits=limits,
                            codec=PlainCodec(tokenizer), sample=_fixed_sampler(tokenizer.encode("abcdefgh")),
                            sampling=SamplingConfig(max_new_tokens=8))
    e = episodes[0]
    assert e.end_reason is EndReason.MAX_EPISODE_TOKENS and e.length <= 20
    assert len(e.logprobs) == sum(e.response_mask)


def test_a_chat_template_wraps_observations_and_leaves_model_tokens_alone():
    from recipes.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}<|eos|>{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}")
    codec = ChatTemplateCodec(tok)
    assert tok.decode(codec.prompt_tokens("6*7?")) == "[user]6*7?<|eos|>[assistant]"
    # After the model's turn (which ended with its own eos), the template adds the user message and the
    # next assistant header, nothing of the model's turn.
    assert tok.decode(codec.observation_tokens("<result>42</result>")) == "[user]<result>42</result><|eos|>[assistant]"
    assert codec.turn_text(tok.encode("<calc>6*7</calc>") + [tok.eos_token_id]) == "<calc>6*7</calc>"


def test_tool_calls_and_their_errors_are_counted_per_episode():
    tokenizer = AliasingTokenizer(64)
    limits = EpisodeLimits(max_turns=3)
    episodes = run_episodes(_specs(1), environment="calculator", options={}, limits=limits,
                            codec=PlainCodec(tokenizer), sample=_fixed_sampler(tokenizer.encode("<calc>6*</calc>")),
                            sampling=SamplingConfig(max_new_tokens=16))
    e = episodes[0]
    assert (e.end_reason, e.turns, e.tool_calls, e.tool_errors) == (EndReason.MAX_TURNS, 3, 3, 3)
    observations = [t for t, m in zip(e.response_ids, e.response_mask) if not m]
    assert tokenizer.decode(observations).count("<error>") == 2  # no observation after the last turn
    episodes = run_episodes(_specs(1), environment="calculator", options={}, limits=limits,
                            codec=PlainCodec(tokenizer), sample=_fixed_sampler(tokenizer.encode("<calc>6*7</calc>")),
                            sampling=SamplingConfig(max_new_tokens=16))
    assert (episodes[0].tool_calls, episodes[0].tool_errors) == (3, 0)


def test_an_episode_budget_past_the_models_longest_sequence_is_refused_before_any_episode(model_dir):
    from services.rollout.episodes.requests import EpisodeRequest

    engine = TorchEngine(TorchEngineConfig(dtype="float32", max_context_tokens=64))
    engine.load(str(model_dir), 0)
    assert engine.max_sequence_tokens() == 64
    request = EpisodeRequest("test-feedback", {}, EpisodeLimits(max_episode_tokens=65), tuple(_specs(1)),
                             SamplingConfig(max_new_tokens=4), 1)
    with pytest.raises(ValueError, match=r"episode.limits_json: max_episode_tokens 65 exceeds .* \(64\)"):
        engine.run_episodes(request)
    episodes = engine.run_episodes(EpisodeRequest("test-feedback", {}, EpisodeLimits(max_turns=2, max_episode_tokens=64),
                                                  tuple(_specs(2)), SamplingConfig(max_new_tokens=4), 1))
    assert [e.turns for e in episodes] == [2, 2] and all(e.length <= 64 for e in episodes)

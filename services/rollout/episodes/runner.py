"""Multi-turn episodes, token in and token out.

An episode is prompt (the environment's first observation, tokenized), then model turns and the
environment's observations in turn. What keeps the trainer's log-probs equal to the sampler's:

- every model turn is sampled after the episode's whole context as token ids, and its sampled tokens are
  appended as sampled. The environment reads the turn as text, but that text is never encoded back: a
  tokenizer's decode-then-encode round trip can change tokens (`"a" "b"` decodes to `"ab"`, which encodes
  as one token), and a trajectory holding re-encoded tokens would score tokens the model never sampled;
- only an observation (text the environment wrote) is encoded, and its tokens are appended after the
  turn, marked False in the response mask; the model's tokens are marked True and carry their sampled
  log-probs, environment tokens carry none.

The loop is engine-agnostic: `TurnSampler` is whatever samples continuations of token-id contexts (the
embedded decoder, or one SGLang /generate; see Engine.sample_turns). Environments run in processes of
their own (environment_host.py), so a failing one ends its episode with a named reason and nothing else.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol

from contract.environment import EndReason, EpisodeLimits, EpisodeProblem
from services.rollout.episodes.environment_host import EpisodeEnded, EpisodeEnvironment
from services.rollout.types import SamplingConfig


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ObservationCodec(Protocol):
    """How text crosses into tokens and back for an episode."""

    def prompt_tokens(self, observation: str) -> list[int]:
        """The first observation, as the prompt the model starts from."""

    def observation_tokens(self, observation: str) -> list[int]:
        """A later observation, as the tokens appended after the model's turn."""

    def turn_text(self, token_ids: Sequence[int]) -> str:
        """A model turn as the text the environment reads."""


@dataclass(frozen=True)
class PlainCodec:
    """For a model without a chat template (the tiny character-level models): text is encoded as is."""

    tokenizer: TextTokenizer

    def prompt_tokens(self, observation: str) -> list[int]:
        return list(self.tokenizer.encode(observation))

    def observation_tokens(self, observation: str) -> list[int]:
        return list(self.tokenizer.encode(observation))

    def turn_text(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))


_PLACEHOLDER = "\x00lockstep-turn\x00"


@dataclass(frozen=True)
class ChatTemplateCodec:
    """For a Hugging Face tokenizer with a chat template: the first observation is a user message; a later
    one is rendered as a `role` message after an assistant turn, and only what the template adds after that
    turn is encoded (the rendering of a conversation that ends with a placeholder assistant message is cut
    where the placeholder's turn ends; the model's own tokens stand in for that turn)."""

    tokenizer: object  # transformers.PreTrainedTokenizerBase
    role: str = "user"

    def prompt_tokens(self, observation: str) -> list[int]:
        return list(self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": observation}], add_generation_prompt=True, tokenize=True,
            return_dict=False))

    def observation_tokens(self, observation: str) -> list[int]:
        before = [{"role": "user", "content": "."}, {"role": "assistant", "content": _PLACEHOLDER}]
        rendered = self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            before + [{"role": self.role, "content": observation}], add_generation_prompt=True, tokenize=False)
        cut = rendered.find(_PLACEHOLDER)
        if cut < 0:
            raise ValueError("the chat template does not render the assistant's content")
        tail = rendered[cut + len(_PLACEHOLDER):]
        # The model's turn ends with its own stop token; the template's closing of that turn is dropped up
        # to the first character the observation's message adds (after the eos the model already sampled).
        eos = getattr(self.tokenizer, "eos_token", None) or ""
        if eos and tail.startswith(eos):
            tail = tail[len(eos):]
        return list(self.tokenizer.encode(tail, add_special_tokens=False))  # type: ignore[attr-defined]

    def turn_text(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)  # type: ignore[attr-defined]


class _HFText:
    """A Hugging Face tokenizer as a TextTokenizer: no special tokens added on encode (the environment writes
    the whole text), none written on decode (the environment reads the model's words)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def episode_codec(model_path: str) -> ObservationCodec:
    """The codec of a model directory's tokenizer: its chat template when it has one, plain text otherwise."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if getattr(tokenizer, "chat_template", None):
        return ChatTemplateCodec(tokenizer)
    return PlainCodec(_HFText(tokenizer))


@dataclass(frozen=True)
class SampledTurn:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


TurnSampler = Callable[[list[list[int]], list[int], SamplingConfig, list[str]], list[SampledTurn]]
"""(contexts, seeds, sampling, episode sample ids) -> one continuation per context, sampled from that seed's
stream. An episode's next context extends its previous one: an engine may keep what it computed for it."""


@dataclass(frozen=True)
class EpisodeSpec:
    group_id: str
    index: int
    problem: EpisodeProblem
    seed: int


@dataclass
class Episode:
    group_id: str
    index: int
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[bool] = field(default_factory=list)
    """True at each token the model sampled, False at each observation token."""
    logprobs: list[float] = field(default_factory=list)
    """The model tokens' sampled log-probs, in order (one per True in response_mask)."""
    turn_rewards: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    end_reason: EndReason | None = None
    end_message: str = ""

    @property
    def sample_id(self) -> str:
        return f"{self.group_id}/{self.index}"

    @property
    def reward(self) -> float:
        """The sum of the environment's per-turn rewards (what it returned before the episode ended)."""
        return float(sum(self.turn_rewards))

    @property
    def trainable(self) -> bool:
        """Has at least one model token (an environment that failed in reset() leaves none)."""
        return any(self.response_mask)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


TURN_SEED_STRIDE = 0x9E3779B97F4A7C15
"""Turn t of an episode samples from seed + t * this (mod 2**64): every turn draws a stream of its own."""


def turn_seed(seed: int, turn: int) -> int:
    return (seed + turn * TURN_SEED_STRIDE) % 2**64


def run_episodes(specs: Sequence[EpisodeSpec], *, environment: str, options: dict, limits: EpisodeLimits,
                 codec: ObservationCodec, sample: TurnSampler, sampling: SamplingConfig,
                 ended: Callable[[list[str]], None] | None = None) -> list[Episode]:
    """Every episode of `specs`, turn by turn, all live episodes of a turn sampled in one call. Each ends
    with an EndReason; one whose environment fails in reset() has no tokens (not `trainable`).
    `sampling.max_new_tokens` bounds one turn. `ended` is told the sample ids of the episodes that ended
    after each turn (the sampler may drop what it kept for them)."""
    episodes = [Episode(s.group_id, s.index) for s in specs]
    envs: list[EpisodeEnvironment | None] = [None] * len(specs)
    pool = ThreadPoolExecutor(max_workers=max(1, min(16, len(specs))), thread_name_prefix="environment")
    try:
        def start(i: int) -> None:
            env = envs[i] = EpisodeEnvironment(environment, options, limits)
            try:
                episodes[i].prompt_ids = codec.prompt_tokens(env.reset(specs[i].problem))
            except EpisodeEnded as ended:
                _end(episodes[i], ended.reason, ended.message)
                return
            if len(episodes[i].prompt_ids) >= limits.max_episode_tokens:
                _end(episodes[i], EndReason.MAX_EPISODE_TOKENS, "the first observation fills the episode")
                episodes[i].prompt_ids = []  # nothing to train on: no room for a model token

        list(pool.map(start, range(len(specs))))
        for turn in range(limits.max_turns):
            live = [i for i, e in enumerate(episodes) if e.end_reason is None]
            if not live:
                break
            # One call per distinct room left, so no turn runs past max_episode_tokens.
            by_room: dict[int, list[int]] = {}
            for i in live:
                room = min(sampling.max_new_tokens, limits.max_episode_tokens - episodes[i].length)
                by_room.setdefault(room, []).append(i)
            for room, members in sorted(by_room.items()):
                turns = sample([episodes[i].prompt_ids + episodes[i].response_ids for i in members],
                               [turn_seed(specs[i].seed, turn) for i in members],
                               replace(sampling, max_new_tokens=room), [episodes[i].sample_id for i in members])
                for i, t in zip(members, turns):
                    e = episodes[i]
                    e.response_ids += t.token_ids
                    e.response_mask += [True] * len(t.token_ids)
                    e.logprobs += t.logprobs
                    e.turns += 1

            def react(i: int) -> None:
                e, env = episodes[i], envs[i]
                assert env is not None
                turn_tokens = e.response_ids[len(e.response_ids) - _last_turn_length(e):]
                try:
                    result = env.step(codec.turn_text(turn_tokens))
                except EpisodeEnded as ended:
                    _end(e, ended.reason, ended.message)
                    return
                e.turn_rewards.append(result.reward)
                e.tool_calls += int(result.tool_call)
                e.tool_errors += int(result.tool_error)
                if result.done:
                    _end(e, EndReason.DONE, "")
                elif e.turns >= limits.max_turns:
                    _end(e, EndReason.MAX_TURNS, f"{e.turns} turns")
                else:
                    observation = codec.observation_tokens(result.observation)
                    # An observation needs room for at least one model token after it, or it is useless.
                    if e.length + len(observation) >= limits.max_episode_tokens:
                        _end(e, EndReason.MAX_EPISODE_TOKENS, f"{e.length} tokens before an observation of "
                             f"{len(observation)}")
                        return
                    e.response_ids += observation
                    e.response_mask += [False] * len(observation)

            for i in live:
                if episodes[i].length >= limits.max_episode_tokens:
                    _end(episodes[i], EndReason.MAX_EPISODE_TOKENS, f"{episodes[i].length} tokens")
            list(pool.map(react, [i for i in live if episodes[i].end_reason is None]))
            if ended is not None:
                ended([episodes[i].sample_id for i in live if episodes[i].end_reason is not None])
    finally:
        pool.shutdown(wait=True)
        for env in envs:
            if env is not None:
                env.close()
    return episodes


def _last_turn_length(e: Episode) -> int:
    n = 0
    for is_model in reversed(e.response_mask):
        if not is_model:
            break
        n += 1
    return n


def _end(e: Episode, reason: EndReason, message: str) -> None:
    e.end_reason, e.end_message = reason, message

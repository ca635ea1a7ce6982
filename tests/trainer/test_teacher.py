"""On-policy distillation in the trainer: the teacher as a scoring rank beside the student, on the real path.

A larger tiny teacher and a smaller tiny student share the char tokenizer. In numerics 'true_on_policy' the
teacher's log-probs (and argmax) of a sequence are the same bits scored alone or packed with others, at any
microbatch budget; a step's distillation advantage trains the student even where every task advantage is 0;
the step reports the reverse KL and argmax agreement computed from the teacher's own scores; a teacher whose
vocabulary differs is refused naming teacher.model_path.
"""
from __future__ import annotations

import json

import pytest
import torch

from kernels.attention import REGISTRY
from recipes.char_tokenizer import CharVocab
from recipes.tiny_model import TinyQwen3Config, build_model_dir, build_tiny_qwen3, save_model_dir
from services.trainer.data.batching import TrainSample, canonical_order
from services.trainer.data.wire import InvalidRequest, StepRequest
from services.trainer.run_setup import build_microbatches
from services.trainer.teacher import score_microbatch
from services.trainer.trainer import Trainer

pytestmark = pytest.mark.usefixtures("restore_torch_globals")

STUDENT = TinyQwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, intermediate_size=128, initializer_range=0.2)
TEACHER = TinyQwen3Config(hidden_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=24, intermediate_size=192, initializer_range=0.2)


@pytest.fixture(autouse=True)
def restore_attention_policy():
    saved = REGISTRY.policy
    yield
    REGISTRY.set_policy(saved)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    return build_model_dir(root / "student", STUDENT, seed=3), build_model_dir(root / "teacher", TEACHER, seed=4)


def configure(student, teacher, *, dtype="float32", budget=64, run_id="d", device="cpu",
              **teacher_settings) -> Trainer:
    t = Trainer(device=device, num_threads=1)
    t.configure(run_id=run_id, model_path=str(student), seed=7, config_json=json.dumps({
        "numerics": "true_on_policy", "dtype": dtype, "microbatch_tokens": budget, "lr": 1e-2,
        "teacher": {"model_path": str(teacher), **teacher_settings}}))
    return t


def samples(n: int = 7, *, seed: int = 0, advantage: float = 0.0) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(4, 90, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)
        response = torch.randint(4, 90, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
        out.append(TrainSample(f"g{i // 2}/{i}", f"g{i // 2}", prompt, response,
                               torch.zeros(len(response)), 0.0, advantage))
    return out


def teacher_scores_by_sample(trainer: Trainer, batch: list[TrainSample], budget: int) -> dict[str, tuple]:
    """Each sample's teacher log-probs and argmax, as the trainer's teacher pass scores its microbatches."""
    run = trainer.run
    config = run.config.model_copy(update={"microbatch_tokens": budget})
    ids = [s.sample_id for s in canonical_order(batch)]
    out: dict[str, list] = {}
    for mb in build_microbatches(batch, config):
        mb = mb.to(trainer.device)
        scores = score_microbatch(run.teacher, mb, temperature=config.temperature)
        for index in mb.response_sample_index.unique().tolist():
            rows = mb.response_sample_index == index
            out[ids[index]] = (scores.logp[rows].cpu(), scores.argmax[rows].cpu())
    return out


def check_alone_equals_batched(student, teacher, dtype: str, device: str = "cpu") -> None:
    trainer = configure(student, teacher, dtype=dtype, device=device)
    batch = samples()
    packed = {budget: teacher_scores_by_sample(trainer, batch, budget) for budget in (24, 64, 4096)}
    for s in batch:
        alone_logp, alone_argmax = teacher_scores_by_sample(trainer, [s], 4096)[s.sample_id]
        assert alone_logp.numel() == s.num_response_tokens and torch.isfinite(alone_logp).all()
        for budget, scored in packed.items():
            logp, argmax = scored[s.sample_id]
            assert torch.equal(logp.view(torch.int32), alone_logp.view(torch.int32)), (s.sample_id, budget)
            assert torch.equal(argmax, alone_argmax), (s.sample_id, budget)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_teacher_log_probs_of_a_sequence_are_the_same_bits_alone_and_batched(dirs, dtype):
    check_alone_equals_batched(*dirs, dtype)


def on_policy(trainer: Trainer, batch: list[TrainSample]) -> list[TrainSample]:
    """The batch with the rollout log-probs a true_on_policy rollout at the trainer's weights reports."""
    scored = trainer.score_tokens(StepRequest(trainer.run.run_id, 1, 0, batch))
    ordered = canonical_order(batch)
    out = []
    for i, s in enumerate(ordered):
        logp = scored.logp[scored.sample_index == i]
        out.append(TrainSample(s.sample_id, s.group_id, s.prompt_ids, s.response_ids, logp, s.reward, s.advantage))
    return out


def test_a_distillation_step_trains_on_the_teachers_signal_and_reports_it(dirs):
    student, teacher = dirs
    trainer = configure(student, teacher)
    batch = on_policy(trainer, samples(advantage=0.0))  # every task advantage 0: only the teacher's signal
    teacher_logp = teacher_scores_by_sample(trainer, batch, 4096)
    out = trainer.train_step(StepRequest("d", 1, 0, batch))
    m = out.metrics
    # Step 1 of a true_on_policy run: the student's log-probs are the rollout's bits, IW exactly 1.
    assert m["logprob_abs_diff_max"] == 0.0 and m["iw_min"] == m["iw_max"] == 1.0
    assert m["grad_norm"] > 0  # without the teacher every advantage is 0 and so is the gradient
    diffs = torch.cat([s.rollout_logprobs.double() - teacher_logp[s.sample_id][0].double() for s in batch])
    assert m["distill_reverse_kl"] == pytest.approx(diffs.mean().item(), rel=1e-12)
    assert m["distill_reverse_kl"] != 0.0
    assert 0.0 <= m["distill_argmax_agreement"] <= 1.0
    assert m["teacher_scoring_seconds"] > 0
    # With ratio 1 and advantages teacher - student, the token-mean PPO loss is their negated mean: the KL.
    assert m["loss"] == pytest.approx(m["distill_reverse_kl"], rel=1e-5)

    plain = Trainer(num_threads=1)
    plain.configure(run_id="p", model_path=str(student), seed=7, config_json=json.dumps({
        "numerics": "true_on_policy", "microbatch_tokens": 64, "lr": 1e-2}))
    m_plain = plain.train_step(StepRequest("p", 1, 0, batch)).metrics
    assert m_plain["grad_norm"] == 0.0 and "distill_reverse_kl" not in m_plain


def test_a_teacher_with_another_vocabulary_is_refused_naming_it(dirs, tmp_path):
    student, _ = dirs
    other = save_model_dir(build_tiny_qwen3(STUDENT, seed=1, vocab=CharVocab(characters=tuple("0123456789+="))),
                           tmp_path / "other")
    with pytest.raises(InvalidRequest, match=r"trainer_config_json\.teacher\.model_path: .*16 tokens"):
        configure(student, other)

"""The demo's parts: char tokenizer, arithmetic task, tiny Qwen3 model dir, warm start."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.char_tokenizer import (
    BOS_ID,
    CHARACTERS,
    EOS_ID,
    EOS_TOKEN,
    PAD_ID,
    PAD_TOKEN,
    UNK_ID,
    build_char_tokenizer,
    save_char_tokenizer,
)
from recipes.tiny_arith import MODEL, TASK_OPTIONS
from recipes.tiny_model import TinyQwen3Config, build_model_dir, build_tiny_qwen3
from services.coordinator.tasks import build_task
from services.coordinator.tasks.arithmetic import EOS_TEXT, ArithmeticConfig, ArithmeticTask, parse_answer

REPO = Path(__file__).resolve().parents[2]
SMALL = TinyQwen3Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16, intermediate_size=64)


# ---------------------------------------------------------------- tokenizer

def test_tokenizer_round_trips_every_character_and_adds_nothing():
    tok = build_char_tokenizer()
    text = "".join(CHARACTERS) + "\n12+34=46"
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character, no BOS/EOS added
    assert tok(text)["input_ids"] == ids
    assert tok.decode(ids) == text
    assert tok.encode("") == []


def test_tokenizer_special_ids_are_fixed():
    tok = build_char_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (PAD_ID, BOS_ID, EOS_ID, UNK_ID)
    assert len(tok) == 4 + len(CHARACTERS)
    assert tok.decode([tok.encode("7")[0], EOS_ID]) == "7" + EOS_TOKEN
    assert tok.decode([tok.encode("7")[0], EOS_ID, PAD_ID], skip_special_tokens=True) == "7"
    assert tok.encode("é\t") == [UNK_ID, UNK_ID]  # outside the vocabulary: unk, not an error


def test_the_arithmetic_task_ends_a_response_where_the_demo_tokenizer_writes_eos():
    # The task does not import the demo's tokenizer; the two spellings of eos are kept equal here.
    tok = build_char_tokenizer()
    assert EOS_TEXT == EOS_TOKEN == tok.decode([EOS_ID])
    assert parse_answer(tok.decode([*tok.encode("42"), EOS_ID, *tok.encode("7")])) == "42"


def test_tokenizer_saved_dir_loads_through_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    save_char_tokenizer(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "987+13=1000\n"
    assert loaded.encode(text) == build_char_tokenizer().encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert loaded.eos_token_id == EOS_ID and loaded.pad_token_id == PAD_ID


# ---------------------------------------------------------------- task

def _pair(problem):
    a, b = problem.prompt.removesuffix("=").split("+")
    return int(a), int(b)


@pytest.mark.parametrize("digits", [2, 3])
def test_task_splits_are_disjoint_and_well_formed(digits):
    task = ArithmeticTask(ArithmeticConfig(seed=5, digits=digits, heldout_size=150, train_size=3000))
    train, heldout = task.split("train"), task.split("heldout")
    assert len(heldout) == 150 and len(train) == 3000
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    for p in (*train, *heldout):
        a, b = _pair(p)
        assert lo <= a <= hi and lo <= b <= hi
        assert p.answer == str(a + b)
    # Disjoint over unordered pairs: a held-out a+b is not trained as b+a either.
    unordered = lambda ps: {tuple(sorted(_pair(p))) for p in ps}  # noqa: E731
    assert not unordered(train) & unordered(heldout)
    assert len(unordered(train)) == len(train)  # no duplicates within a split
    ids = [p.problem_id for p in (*train, *heldout)]
    assert len(set(ids)) == len(ids)


def test_task_small_space_uses_every_remaining_pair():
    cfg = ArithmeticConfig(seed=0, digits=2, heldout_size=200)
    task = ArithmeticTask(cfg)
    assert len(task.split("train")) == cfg.num_unordered_pairs - 200  # 4095 - 200


def test_task_splits_are_deterministic_and_seeded():
    cfg = ArithmeticConfig(seed=3, digits=3, heldout_size=50, train_size=500)
    assert ArithmeticTask(cfg).split("train") == ArithmeticTask(cfg).split("train")
    assert ArithmeticTask(cfg).split("heldout") == ArithmeticTask(cfg).split("heldout")
    other = ArithmeticTask(ArithmeticConfig(seed=4, digits=3, heldout_size=50, train_size=500))
    assert other.split("heldout") != ArithmeticTask(cfg).split("heldout")


def test_task_rejects_bad_options():
    with pytest.raises(ValueError, match="digits"):
        ArithmeticTask(ArithmeticConfig(digits=0))
    with pytest.raises(ValueError, match="heldout_size"):
        ArithmeticTask(ArithmeticConfig(digits=1, heldout_size=55))  # all 55 unordered 1-digit pairs
    with pytest.raises(ValueError, match="split"):
        ArithmeticTask().split("validation")
    with pytest.raises(ValueError, match="bogus"):
        build_task("arithmetic", {"bogus": 1})


def test_reward_correct_incorrect_and_garbage():
    task = ArithmeticTask(ArithmeticConfig(digits=2))
    p = task.split("heldout")[0]
    a, b = _pair(p)
    right, wrong = str(a + b), str(a + b + 1)
    assert task.reward(p, right) == 1.0
    assert task.reward(p, right + EOS_TOKEN) == 1.0
    assert task.reward(p, f" {right}\n") == 1.0                 # surrounding whitespace is not an answer change
    assert task.reward(p, right + EOS_TOKEN + "999") == 1.0     # text after eos is not part of the response
    assert task.reward(p, wrong) == 0.0
    assert task.reward(p, wrong + EOS_TOKEN + right) == 0.0
    assert task.reward(p, right[:1] + PAD_TOKEN + right[1:]) == 0.0  # a special token inside the answer
    for garbage in ["", EOS_TOKEN, "   ", f"{right} {right}", f"{right}x", f"-{right}", f"0{right}",
                    f"{right}.0", "٣", "²", "\x00" * 5, "9" * 10_000, f"{p.prompt}{right}"]:
        assert task.reward(p, garbage) == 0.0, repr(garbage)
    assert task.reward(p, None) == 0.0  # type: ignore[arg-type]


def test_parse_answer_and_reversed_answers():
    assert parse_answer("123<|eos|>") == "123"
    assert parse_answer("12 3") is None
    task = ArithmeticTask(ArithmeticConfig(digits=2, reverse_answer=True))
    p = task.split("train")[0]
    a, b = _pair(p)
    assert p.answer == str(a + b)[::-1]
    assert task.reward(p, str(a + b)[::-1]) == 1.0


def test_demo_recipe_uses_the_task_the_warm_start_trained_on():
    import yaml

    recipe = yaml.safe_load((REPO / "recipes" / "tiny_arith" / "recipe.yaml").read_text())
    # Same split seed and digits, or the run's held-out set overlaps the warm start's training data.
    assert recipe["task"]["name"] == "arithmetic"
    options = dict(recipe["task"]["options"])
    assert ArithmeticConfig(**options) == ArithmeticConfig(**TASK_OPTIONS)


# ---------------------------------------------------------------- model

def test_model_dir_loads_through_auto_classes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_model_dir(tmp_path, SMALL, seed=11)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (BOS_ID, EOS_ID, PAD_ID)
    assert (tmp_path / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert cfg["vocab_size"] == len(tok)
    fresh = build_tiny_qwen3(SMALL, seed=11)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.tensor([tok.encode("12+34=")])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 6, len(tok)) and torch.isfinite(logits).all()


def test_model_init_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_qwen3(SMALL, seed=1)
    after = torch.rand(1)
    assert torch.equal(before, after)
    b = build_tiny_qwen3(SMALL, seed=1)
    c = build_tiny_qwen3(SMALL, seed=2)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_model_config_validation():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        build_tiny_qwen3(TinyQwen3Config(num_attention_heads=4, num_key_value_heads=3), seed=0)
    MODEL.validate()


# ---------------------------------------------------------------- warm start

def _prepare_both(outs: list[Path], seed: int) -> list[dict]:
    """Run prepare once per dir, concurrently (each pins one thread), and parse its JSON line."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # target 1.0 never triggers the early stop, so every run takes exactly max-steps steps.
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "recipes.tiny_arith.prepare", "--out", str(out), "--seed", str(seed),
             "--max-steps", "4", "--target-accuracy", "1.0", "--threads", "1"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for out in outs
    ]
    infos = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        infos.append(json.loads(stdout.strip().splitlines()[-1]))
    return infos


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_warm_start_is_deterministic_and_writes_a_loadable_dir(tmp_path):
    from transformers import AutoModelForCausalLM

    first, second = _prepare_both([tmp_path / "a", tmp_path / "b"], 7)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")  # bitwise-identical weights
    for info in (first, second):
        assert info["warm_start_steps"] == 4 and info["reached_target"] is False
        assert 0.0 <= info["heldout_accuracy"] <= 1.0 and info["heldout_size"] == TASK_OPTIONS["heldout_size"]
        assert info["seconds"] > 0 and info["final_loss"] > 0
    assert first["heldout_accuracy"] == second["heldout_accuracy"]
    # Training moved the weights away from the seed's initialisation.
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"))
    init = build_tiny_qwen3(MODEL, seed=7)
    assert not torch.equal(trained.model.embed_tokens.weight, init.model.embed_tokens.weight)


def test_the_moe_variant_prepares_a_qwen3_moe_policy_directory(tmp_path):
    """`demo --moe`: the warm start runs on a tiny Qwen3-MoE and writes a directory the services load (the
    learning itself is measured by the demo run; the numbers are in the commit that added the variant)."""
    from recipes.tiny_arith import MOE_MODEL, WarmStartConfig
    from recipes.tiny_arith.demo import warm_start_fingerprint
    from recipes.tiny_arith.prepare import prepare

    info = prepare(tmp_path / "moe", seed=0, moe=True,
                   warm=WarmStartConfig(max_steps=2, check_every=1, probe_size=8, batch_size=8))
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert config.get("num_experts", config.get("num_local_experts")) == MOE_MODEL.num_experts
    assert info["warm_start_steps"] == 2
    assert warm_start_fingerprint(0, moe=True) != warm_start_fingerprint(0)

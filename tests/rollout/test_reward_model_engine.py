"""The reward-model engine of a scorer replica, on CPU: a batch scores as its items one at a time (padding
changes nothing but rounding), items render through the chat template, and a model that is not a one-label
classifier with a chat template, or a weight update, is refused naming why; so is a reward model on SGLang."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.rollout.scorer.reward_model import RewardModelEngine
from recipes.tiny_model import build_model_dir
from services.rollout.scorer.role import check_score_request, check_scorer_engine, weight_files_sha256
from proto import lockstep_pb2 as pb
from tests.coordinator.rewards.test_reward_spec import reward_model_dir

PAIRS = [("12+34=", "46"), ("1+1=", "2"), ("99+99=", "198"), ("5+70=", "75999"), ("0+0=", "")]


@pytest.fixture(scope="module")
def rm(tmp_path_factory) -> Path:
    return reward_model_dir(tmp_path_factory.mktemp("rm"))


def engine(path: Path, batch: int) -> RewardModelEngine:
    e = RewardModelEngine.from_config_json(json.dumps({"max_batch_size": batch}))
    e.load(str(path), 0)
    return e


def test_a_batch_scores_as_its_items_alone(rm):
    batched, alone = engine(rm, 8).score(PAIRS), engine(rm, 1).score(PAIRS)
    assert len(batched) == len(PAIRS) and len(set(batched)) == len(PAIRS)
    assert batched == pytest.approx(alone, abs=1e-5)


def test_items_render_through_the_chat_template(rm):
    e = engine(rm, 4)
    ids = e.encode("1+1=", "2")
    assert e._tokenizer.decode(ids, skip_special_tokens=False) == "1+1=2<|eos|>"


def test_what_is_not_a_one_label_reward_model_is_refused(rm, tmp_path):
    two = tmp_path / "two"
    two.mkdir()
    for f in rm.iterdir():
        (two / f.name).write_bytes(f.read_bytes())
    config = json.loads((two / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**config, "num_labels": 2, "id2label": {"0": "a", "1": "b"},
                                                 "label2id": {"a": 0, "b": 1}}))
    with pytest.raises(Exception, match="num_labels 1|labels"):
        engine(two, 4)
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in rm.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    tok = json.loads((plain / "tokenizer_config.json").read_text())
    tok.pop("chat_template")
    (plain / "tokenizer_config.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="chat template"):
        engine(plain, 4)
    with pytest.raises(ValueError, match="fixed"):
        engine(rm, 4).update_weights({}, 1)


def test_the_weights_digest_follows_the_files_and_requests_are_checked(rm, tmp_path):
    digest = weight_files_sha256(str(rm))
    assert len(digest) == 64 and digest == weight_files_sha256(str(rm))
    item = pb.ScoreItem(item_id="a", prompt="1+1=", response="2")
    with pytest.raises(ValueError, match="items: empty"):
        check_score_request(pb.ScoreRequest(), "reward_model")
    with pytest.raises(ValueError, match="repeated"):
        check_score_request(pb.ScoreRequest(items=[item, item]), "reward_model")
    with pytest.raises(ValueError, match="judge_template"):
        check_score_request(pb.ScoreRequest(items=[item], judge_template="{response}"), "reward_model")
    with pytest.raises(ValueError, match="judge_template"):
        check_score_request(pb.ScoreRequest(items=[item], judge_template="{answer}", max_new_tokens=4), "torch")
    with pytest.raises(ValueError, match="max_new_tokens"):
        check_score_request(pb.ScoreRequest(items=[item], judge_template="{response}"), "torch")
    with pytest.raises(ValueError, match="judge_template"):  # SGLang serves judges: the same checks as torch
        check_score_request(pb.ScoreRequest(items=[item], judge_template="{answer}", max_new_tokens=4), "sglang")
    check_score_request(pb.ScoreRequest(items=[item], judge_template="{response}", max_new_tokens=4), "sglang")
    with pytest.raises(ValueError, match="does not score"):
        check_score_request(pb.ScoreRequest(items=[item]), "another")


def test_a_reward_model_on_sglang_is_refused_before_anything_launches(rm, tmp_path):
    with pytest.raises(ValueError, match=r"engine_config_json.engine: SGLang cannot serve .*random initialization"
                                         r".*Qwen3ForSequenceClassification"):
        check_scorer_engine("scorer", "sglang", rm)
    judge = build_model_dir(tmp_path / "judge", seed=0)
    check_scorer_engine("scorer", "sglang", judge)  # a causal LM: a judge SGLang serves
    check_scorer_engine("scorer", "torch", judge)
    check_scorer_engine("scorer", "reward_model", rm)
    check_scorer_engine("policy", "sglang", rm)  # a policy replica's own load refuses what it cannot generate with
    with pytest.raises(ValueError, match="role 'policy'"):
        check_scorer_engine("policy", "reward_model", rm)
    with pytest.raises(ValueError, match="role 'scorer'"):
        check_scorer_engine("scorer", "another", judge)

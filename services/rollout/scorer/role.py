"""The scorer role of a rollout replica (RolloutServiceConfig.role 'scorer', docs/rewards.md): Score calls
over the loaded engine.

- engine `reward_model` (reward_model.py): one scalar per item from the sequence-classification head;
- engine `torch` or `sglang` as a generative judge: each item's judge prompt is the request's template with the
  item's prompt, response and reference put in (contract/judge_template.py), rendered through the model's chat
  template when it has one (as the episode runner renders observations), then decoded greedily up to
  max_new_tokens (by the torch engine's continuous scheduler, or one batched /generate of token ids to the
  SGLang server); the verdict is the decoded text, read by the same tokenizer whichever engine decoded it.

A reward model on SGLang is refused at load (check_scorer_engine): SGLang's sequence-classification heads do not
compute what the checkpoint's head computes (contract.engine_options.SGLANG_REWARD_MODEL_REFUSAL).

The replica reports what it computed and the digest of the weight files it loaded; it decides no reward.
The coordinator parses verdicts, checks scores and counts failures (services/coordinator/rewards/).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from contract.engine_options import SGLANG_REWARD_MODEL_REFUSAL
from contract.judge_template import check_template, render_template
from proto import lockstep_pb2 as pb
from services.common.models.weight_files import weight_files
from services.rollout.engine import Engine
from services.rollout.types import GenerationRequest, PromptSpec, SamplingConfig

JUDGE_ENGINES = ("torch", "sglang")
"""Engines a generative judge runs on; 'reward_model' is the sequence-classification engine."""
MAX_SCORE_ITEMS = 4096
MAX_VERDICT_TOKENS = 8192
FILE_BLOCK = 1 << 22


def weight_files_sha256(model_path: str) -> str:
    """sha256 over the model's weight files (each file's name and sha256, in from_pretrained's order): the
    scorer's identity in the coordinator's cache keys, step records and fingerprints."""
    outer = hashlib.sha256()
    files = weight_files(Path(model_path))
    if not files:
        raise ValueError(f"model_path: {model_path!r} has no weight files")
    for path in files:
        inner = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(FILE_BLOCK):
                inner.update(block)
        outer.update(path.name.encode() + b"\0" + inner.digest())
    return outer.hexdigest()


def check_scorer_engine(role: str, engine_name: str, model_path: Path) -> None:
    """ValueError naming the field when a replica of `role` may not load `model_path` on `engine_name`: a scorer
    loads a reward model or a judge engine, a policy replica never the reward-model engine, and no sequence
    classifier is served by SGLang."""
    allowed = engine_name in ("reward_model", *JUDGE_ENGINES) if role == "scorer" else engine_name != "reward_model"
    if not allowed:
        raise ValueError(f"engine_config_json.engine: {engine_name!r} cannot be loaded by a replica of role {role!r}")
    if role != "scorer" or engine_name != "sglang":
        return
    try:
        architectures = json.loads((model_path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return  # not a model directory: the engine's load names what is wrong with it
    if any(isinstance(a, str) and a.endswith(("ForSequenceClassification", "ForRewardModel")) for a in architectures):
        raise ValueError(f"engine_config_json.engine: {SGLANG_REWARD_MODEL_REFUSAL} (model_path {str(model_path)!r} "
                         f"is a {architectures[0]})")


def check_score_request(request: pb.ScoreRequest, engine_name: str) -> None:
    """ValueError naming the field of a request this engine cannot score."""
    if not request.items:
        raise ValueError("items: empty")
    if len(request.items) > MAX_SCORE_ITEMS:
        raise ValueError(f"items: {len(request.items)} exceed {MAX_SCORE_ITEMS} per call")
    seen: set[str] = set()
    for i, item in enumerate(request.items):
        if not item.item_id or item.item_id in seen:
            raise ValueError(f"items[{i}].item_id: {'empty' if not item.item_id else 'repeated'}")
        seen.add(item.item_id)
    if engine_name == "reward_model":
        if request.judge_template or request.max_new_tokens:
            raise ValueError("judge_template: a reward model reads no template (the loaded engine is reward_model)")
        return
    if engine_name not in JUDGE_ENGINES:
        raise ValueError(f"engine: the {engine_name} engine does not score; load 'reward_model', 'torch' or 'sglang'")
    try:
        check_template(request.judge_template)
    except ValueError as exc:
        raise ValueError(f"judge_template: {exc}") from None
    if not 1 <= request.max_new_tokens <= MAX_VERDICT_TOKENS:
        raise ValueError(f"max_new_tokens: {request.max_new_tokens} outside [1, {MAX_VERDICT_TOKENS}]")


class ScorerRole:
    """A loaded scorer: its engine, the digest of its weights and, for a judge, the tokenizer it renders with."""

    def __init__(self, engine: Engine, engine_name: str) -> None:
        self.engine, self.engine_name = engine, engine_name
        self.weights_sha256 = weight_files_sha256(engine.model_path)
        self._tokenizer = None
        if engine_name in JUDGE_ENGINES:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(engine.model_path)

    def score(self, request: pb.ScoreRequest) -> pb.ScoreResponse:
        check_score_request(request, self.engine_name)
        items = list(request.items)
        if self.engine_name == "reward_model":
            scores = self.engine.score([(item.prompt, item.response) for item in items])
            results = [pb.ScoreResult(item_id=item.item_id, score=s) for item, s in zip(items, scores)]
        else:
            verdicts = self._judge(items, request.judge_template, request.max_new_tokens)
            results = [pb.ScoreResult(item_id=item.item_id, verdict=v) for item, v in zip(items, verdicts)]
        return pb.ScoreResponse(results=results, weights_sha256=self.weights_sha256, engine=self.engine_name,
                                call_id=request.call_id)

    def _encode(self, text: str) -> list[int]:
        tok = self._tokenizer
        if getattr(tok, "chat_template", None):
            rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)
            return list(tok.encode(rendered, add_special_tokens=False))
        return list(tok.encode(text, add_special_tokens=False))

    def _judge(self, items: list[pb.ScoreItem], template: str, max_new_tokens: int) -> list[str]:
        prompts = tuple(
            PromptSpec(f"judge{i}", tuple(self._encode(render_template(
                template, prompt=item.prompt, response=item.response, reference=item.reference))), 0)
            for i, item in enumerate(items))
        eos = self._tokenizer.eos_token_id
        stops = {eos} if eos is not None else set()
        if self.engine_name == "sglang":
            # SGLang stops at the model's own eos ids whatever a request says (and the engine refuses a
            # request that leaves them out): the verdict ends there on either engine's account.
            from services.rollout.sglang.weights import eos_token_ids

            stops |= eos_token_ids(self.engine.model_path)
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens, greedy=True,
                                  stop_token_ids=tuple(sorted(stops)))
        samples = self.engine.generate(GenerationRequest(prompts=prompts, sampling=sampling))
        by_prompt = {s.group_id: s for s in samples}
        return [self._tokenizer.decode(by_prompt[f"judge{i}"].token_ids, skip_special_tokens=True)
                for i in range(len(items))]

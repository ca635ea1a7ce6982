"""The reward-model engine of a scorer replica: a Hugging Face AutoModelForSequenceClassification with one
scalar head, reading each (prompt, response) through the model directory's chat template.

Scores are what the model's head computes, in float32, nothing more: the coordinator checks them (finite, in
range) and decides what a reward is (services/coordinator/rewards/). A reward model's weights are fixed for the
run, so every weight update is refused, and it generates nothing.

Batching: items are scored in batches of max_batch_size, right-padded, the head read at each item's last real
token (transformers' sequence-classification pooling, which needs the config's pad_token_id). A padded row's
real positions attend only to real positions, so its score does not depend on its neighbours beyond rounding;
the coordinator caches scores by content, never by batch.
"""
from __future__ import annotations

import torch

from contract.engine_options import RewardModelEngineConfig
from services.common.models.directory import check_model_dir
from services.common.models.loading import resolve_dtype
from services.common.models.weight_files import check_weight_files, diagnose
from services.rollout.config import RolloutServiceConfig
from services.rollout.engine import Engine, require_device
from services.rollout.types import GeneratedSample, GenerationRequest


class RewardModelEngine(Engine):
    name = "reward_model"

    def __init__(self, config: RewardModelEngineConfig) -> None:
        self.config = config
        self._model = None
        self._tokenizer = None
        self._model_path = ""
        self._max_tokens: int | None = None

    @classmethod
    def from_config_json(cls, text: str, service: RolloutServiceConfig | None = None) -> "RewardModelEngine":
        return cls(RewardModelEngineConfig.from_json(text))

    def load(self, model_path: str, policy_version: int) -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        device = require_device(self.config.device)
        path = check_model_dir(model_path)
        labels = AutoConfig.from_pretrained(str(path)).num_labels  # before the weights: a head of another size
        if labels != 1:  # would otherwise fail in the loader, naming nothing
            raise ValueError(f"model_path: {model_path!r} has {labels} labels; a reward model has one scalar head "
                             "(num_labels 1)")
        check_weight_files(path)
        try:
            model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=resolve_dtype(self.config.dtype))
        except Exception as exc:
            culprit = diagnose(path)
            if culprit is None:
                raise
            raise culprit from exc
        if self.config.max_batch_size > 1 and model.config.pad_token_id is None:
            raise ValueError(f"model_path: {model_path!r} has no pad_token_id in its config, which batched "
                             "scoring needs to find each item's last token (or set engine_config.max_batch_size 1)")
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"model_path: {model_path!r} has no chat template; a reward model scores "
                             "(prompt, response) as the chat its template renders")
        model.eval()
        model.requires_grad_(False)
        self._model, self._tokenizer, self._model_path = model.to(device), tokenizer, str(model_path)
        self._device = device
        self._max_tokens = getattr(model.config, "max_position_embeddings", None)

    def encode(self, prompt: str, response: str) -> list[int]:
        """The chat (user: prompt, assistant: response) as its template renders it, in token ids."""
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        rendered = self._tokenizer.apply_chat_template(chat, tokenize=False)
        return list(self._tokenizer.encode(rendered, add_special_tokens=False))

    @torch.inference_mode()
    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """One float32 score per (prompt, response), in order. ValueError naming the item for one longer than
        the model's positions."""
        if self._model is None:
            raise ValueError("no model loaded")
        encoded = [self.encode(p, r) for p, r in pairs]
        for i, ids in enumerate(encoded):
            if not ids:
                raise ValueError(f"items[{i}]: renders to no tokens")
            if self._max_tokens is not None and len(ids) > self._max_tokens:
                raise ValueError(f"items[{i}]: {len(ids)} tokens exceed the model's {self._max_tokens} positions")
        pad = self._model.config.pad_token_id or 0
        scores: list[float] = []
        for start in range(0, len(encoded), self.config.max_batch_size):
            batch = encoded[start:start + self.config.max_batch_size]
            width = max(len(ids) for ids in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, ids in enumerate(batch):
                input_ids[row, :len(ids)] = torch.tensor(ids)
                mask[row, :len(ids)] = 1
            if len(batch) > 1:  # pooling reads each row at its last non-pad token: an item ending in pad moves it
                for row, ids in enumerate(batch):
                    if ids[-1] == pad:
                        raise ValueError(f"items[{start + row}]: ends with the pad token {pad}, which batched "
                                         "pooling would skip")
            logits = self._model(input_ids=input_ids.to(self._device), attention_mask=mask.to(self._device)).logits
            scores += logits[:, 0].float().cpu().tolist()
        return scores

    def generate(self, request: GenerationRequest) -> list[GeneratedSample]:
        raise ValueError("engine: a reward model scores (Score); it generates nothing")

    def update_weights(self, tensors: dict[str, torch.Tensor], policy_version: int, *,
                       finite_checked: bool = False) -> None:
        raise ValueError("engine: a reward model's weights are fixed for the run")

    @property
    def policy_version(self) -> int:
        return 0 if self._model is not None else -1

    @property
    def model_path(self) -> str:
        return self._model_path

    def info(self) -> dict[str, str]:
        return {"engine": self.name, "dtype": self.config.dtype, "device": self.config.device}

    def close(self) -> None:
        self._model = None

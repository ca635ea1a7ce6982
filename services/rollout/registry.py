"""Rollout engines by name. An unknown name is an error, never a fallback to another engine.

Each entry is "module:Class"; the module is imported only when a LoadModel
asks for that engine, so heavy optional dependencies (sglang) are needed only
by the processes that use them. An engine class provides
`from_config_json(text: str, service: RolloutServiceConfig) -> Engine`,
validating its own options and raising ValueError that names the offending
field; what the operator decides (interpreters, directories) comes from the
rollout service's own configuration, never from the run's options. Its options
model is in the torch-free contract (contract/engine_options.py, ENGINE_OPTIONS,
under the same names), so that the coordinator refuses bad engine_options at
submit time with the same message LoadModel would give.
"""
from __future__ import annotations

import importlib

from services.rollout.config import RolloutServiceConfig
from services.rollout.engine import Engine

ENGINES: dict[str, str] = {
    "torch": "services.rollout.embedded.torch_engine:TorchEngine",
    "sglang": "services.rollout.sglang.engine:SGLangEngine",
    "reward_model": "services.rollout.scorer.reward_model:RewardModelEngine",
}


def known_engines() -> list[str]:
    return sorted(ENGINES)


def engine_class(name: str) -> type[Engine]:
    """The class registered as `name`; ValueError listing the known engines otherwise."""
    target = ENGINES.get(name)
    if target is None:
        raise ValueError(f"engine: unknown engine {name!r}; known engines: {known_engines()}")
    module_name, _, cls_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise TypeError(f"engine registry: {target} is not an Engine subclass")
    return cls


def build_engine(name: str, config_json: str, service: RolloutServiceConfig) -> Engine:
    """Construct (not load) the named engine from its JSON options and the service's own configuration."""
    return engine_class(name).from_config_json(config_json, service)

from __future__ import annotations

import pytest

from services.common.process.service_config import parse_service_config
from services.coordinator.config import CoordinatorConfig


def test_flag_beats_env_beats_default(monkeypatch):
    monkeypatch.setenv("LOCKSTEP_COORDINATOR_PORT", "9000")
    monkeypatch.setenv("LOCKSTEP_COORDINATOR_ROLLOUT_ADDRESSES", "a:1, b:2")
    cfg = parse_service_config(CoordinatorConfig, env_prefix="LOCKSTEP_COORDINATOR", argv=[])
    assert cfg.port == 9000 and cfg.rollout_addresses == ["a:1", "b:2"]
    cfg = parse_service_config(CoordinatorConfig, env_prefix="LOCKSTEP_COORDINATOR", argv=["--port", "9100"])
    assert cfg.port == 9100
    assert cfg.trainer_address == "127.0.0.1:50052"


def test_invalid_value_exits_naming_the_field(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_service_config(CoordinatorConfig, env_prefix="LOCKSTEP_COORDINATOR", argv=["--port", "99999"])
    assert exc.value.code == 2
    assert "port:" in capsys.readouterr().err

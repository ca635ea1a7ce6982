"""RayStackConfig and the placement plan: pure logic."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.ray_stack.config import RayStackConfig
from services.ray_stack.launcher import bundles, ensure_token_file, plan_coordinator, plan_workers


def test_plan_gives_each_service_its_fixed_ports_and_bundle():
    cfg = RayStackConfig(rollout_replicas=3, trainer_gpus=1, rollout_gpus=0.5, trainer_args="--device cuda",
                         rollout_port_base=6000, rollout_metrics_port_base=7000, num_threads=2)
    plans = plan_workers(cfg)
    assert [p.name for p in plans] == ["trainer", "rollout-0", "rollout-1", "rollout-2"]
    assert [p.bundle for p in plans] == [0, 1, 2, 3]
    assert [p.port for p in plans] == [50052, 6000, 6001, 6002]
    runs = str(Path("runs").resolve())
    assert plans[0].args == ("--grpc-port", "50052", "--metrics-port", "9102", "--num-threads", "2",
                             "--model-roots", runs, "--checkpoint-roots", runs, "--device", "cuda")
    assert plans[2].args == ("--grpc-port", "6001", "--metrics-port", "7001", "--num-threads", "2", "--model-roots", runs)
    assert bundles(plans) == [{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 0.5}, {"CPU": 1, "GPU": 0.5},
                              {"CPU": 1, "GPU": 0.5}]
    assert bundles(plan_workers(RayStackConfig())) == [{"CPU": 1}, {"CPU": 1}]  # no GPU key when none asked


def test_coordinator_plan_dials_the_placed_addresses(tmp_path):
    cfg = RayStackConfig(data_dir=str(tmp_path), redis_url="redis://r:6379/0", coordinator_args=["--log-level", "debug"],
                         path_roots="/models, /datasets")
    plan = plan_coordinator(cfg, "10.0.0.1:50052", ["10.0.0.2:50061", "10.0.0.3:50062"])
    assert plan.bundle is None and plan.port == 8000
    roots = f"{tmp_path},/models,/datasets"
    assert plan.args == ("--port", "8000", "--data-dir", str(tmp_path), "--trainer-address", "10.0.0.1:50052",
                         "--rollout-addresses", "10.0.0.2:50061,10.0.0.3:50062", "--model-roots", roots,
                         "--data-roots", roots, "--redis-url", "redis://r:6379/0", "--log-level", "debug")
    # One token for the whole stack, generated once beside the data.
    assert cfg.token_path() == tmp_path / "auth_token"
    first = ensure_token_file(cfg.token_path())
    assert ensure_token_file(cfg.token_path()).secret == first.secret
    assert (tmp_path / "auth_token").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("fields, field, reason", [
    ({"trainer_port": 8000}, "trainer_port", "port 8000 is also coordinator_port's"),
    ({"rollout_replicas": 3, "rollout_port_base": 50050}, "rollout_port_base", "port 50052 is also trainer_port's"),
    ({"rollout_replicas": 2, "rollout_port_base": 65535}, "rollout_port_base", "above 65535"),
    ({"placement_strategy": "RANDOM"}, "placement_strategy", "PACK"),
    ({"rollout_replicas": 0}, "rollout_replicas", "greater than or equal to 1"),
])
def test_bad_config_names_the_field(fields, field, reason):
    with pytest.raises(ValidationError) as err:
        RayStackConfig(**fields)
    assert field in str(err.value) and reason in str(err.value)

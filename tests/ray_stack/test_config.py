"""RayStackConfig and the placement plan: pure logic."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.common.auth import TOKEN_FILE_ENV
from services.common.process.ports import SLICE_ENV
from services.ray_stack.config import RayStackConfig
from services.ray_stack.launcher import (
    actor_env,
    bundles,
    ensure_token_file,
    node_argv,
    plan_coordinator,
    plan_rollouts,
    plan_trainer,
    with_rendezvous,
    with_weight_source,
)


def plan_workers(cfg: RayStackConfig):
    return [*plan_trainer(cfg), *plan_rollouts(cfg)]


def test_plan_gives_each_service_its_fixed_ports_and_bundle():
    cfg = RayStackConfig(rollout_replicas=3, trainer_gpus=1, rollout_gpus=0.5, trainer_args="--device cuda",
                         rollout_port_base=6000, rollout_metrics_port_base=7000, num_threads=2)
    plans = plan_workers(cfg)
    assert [p.name for p in plans] == ["trainer", "rollout-0", "rollout-1", "rollout-2"]
    assert [p.bundle for p in plans] == [0, 0, 1, 2]  # the trainer's placement group, the rollouts' one
    assert [p.port for p in plans] == [50052, 6000, 6001, 6002]
    runs = str(Path("runs").resolve())
    assert plans[0].args == ("--grpc-port", "50052", "--metrics-port", "9102", "--num-threads", "2",
                             "--model-roots", runs, "--checkpoint-roots", runs, "--device", "cuda")
    assert plans[2].args == ("--grpc-port", "6001", "--metrics-port", "7001", "--num-threads", "2", "--model-roots", runs)
    assert bundles(plans) == [{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 0.5}, {"CPU": 1, "GPU": 0.5},
                              {"CPU": 1, "GPU": 0.5}]
    assert bundles(plan_workers(RayStackConfig())) == [{"CPU": 1}, {"CPU": 1}]  # no GPU key when none asked


def test_without_a_broadcast_port_the_services_get_no_broadcast_settings():
    trainer, *rollouts = plan_workers(RayStackConfig(rollout_replicas=2))
    assert trainer.broadcast_port == 0
    assert node_argv(trainer, "10.0.0.1", "py")[:5] == ["py", "-m", "services.trainer", "--host", "10.0.0.1"]
    assert node_argv(trainer, "10.0.0.1", "py")[5:] == list(trainer.args)
    assert not any("broadcast" in a for a in node_argv(trainer, "10.0.0.1", "py"))
    for plan in with_weight_source(rollouts, "10.0.0.1:50052"):
        assert plan.args[-2:] == ("--weight-sources", "10.0.0.1:50052")
        assert not any("broadcast" in a for a in plan.args)


def test_a_broadcast_port_puts_the_rendezvous_on_the_trainers_node_and_in_every_rollouts_sources():
    cfg = RayStackConfig(rollout_replicas=2, trainer_broadcast_port=29500, trainer_args="--device cpu")
    trainer, *rollouts = plan_workers(cfg)
    assert trainer.env == (("NCCL_NVLS_ENABLE", "0"),)
    assert trainer.broadcast_port == 29500 and all(p.broadcast_port == 0 for p in rollouts)
    # The address is the node's, known only where the actor runs: it joins --host there.
    argv = node_argv(trainer, "10.0.0.7", "/venv/bin/python")
    assert argv == ["/venv/bin/python", "-m", "services.trainer", "--host", "10.0.0.7", *trainer.args,
                    "--weight-broadcast-address", "10.0.0.7:29500"]
    assert trainer.args[-2:] == ("--device", "cpu")  # the operator's flags stay as given
    placed = with_weight_source(rollouts, "10.0.0.7:50052", "10.0.0.7:29500")
    assert [p.args[len(r.args):] for p, r in zip(placed, rollouts)] == [
        ("--weight-sources", "10.0.0.7:50052", "--broadcast-sources", "10.0.0.7:29500")] * 2
    assert node_argv(placed[1], "10.0.0.8", "py") == ["py", "-m", "services.rollout", "--host", "10.0.0.8",
                                                      *placed[1].args]


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


def test_a_multi_rank_trainer_is_one_bundle_per_rank_meeting_at_rank_0s_node(tmp_path):
    cfg = RayStackConfig(trainer_world_size=3, trainer_gpus_per_rank=1, trainer_rendezvous_port=29400,
                         trainer_cpus=2, data_dir=str(tmp_path), trainer_env="NCCL_SOCKET_IFNAME=eth0,eth1")
    rank0, *ranks = plan_trainer(cfg)
    assert [p.name for p in (rank0, *ranks)] == ["trainer", "trainer-rank-1", "trainer-rank-2"]
    assert [p.bundle for p in (rank0, *ranks)] == [0, 1, 2]
    assert bundles([rank0, *ranks]) == [{"CPU": 2, "GPU": 1}] * 3
    # Rank 0 serves gRPC and the ranks' store; the device follows the bundle's GPUs.
    assert rank0.args[-6:] == ("--data-parallel", "3", "--rank-rendezvous-port", "29400", "--device", "cuda")
    assert rank0.port == 50052 and all(p.port == 0 and p.module == "services.trainer.distributed.rank" for p in ranks)
    env = {"NCCL_NVLS_ENABLE": "0", "NCCL_SOCKET_IFNAME": "eth0,eth1"}
    assert all(dict(p.env) == env for p in (rank0, *ranks))
    # The others learn the store's address once rank 0 is placed: its node's address.
    placed = with_rendezvous(ranks, "10.0.0.9", 29400)
    assert node_argv(placed[1], "10.0.0.4", "py") == [
        "py", "-m", "services.trainer.distributed.rank", "--host", "10.0.0.4", "--rank", "2", "--rendezvous", "10.0.0.9:29400"]
    cpu = plan_trainer(RayStackConfig(trainer_world_size=2, trainer_rendezvous_port=29400))
    assert cpu[0].args[-2:] == ("--device", "cpu") and bundles(cpu) == [{"CPU": 1}] * 2
    assert cpu[1].args == ("--rank", "1")
    # The other ranks may import the plugins rank 0 was started with, and only those.
    plugins = plan_trainer(RayStackConfig(trainer_world_size=2, trainer_rendezvous_port=29400,
                                          trainer_args="--attention-plugins=a.b,c.d --log-level debug"))
    assert plugins[1].args == ("--rank", "1", "--attention-plugins", "a.b,c.d")
    # NCCL_NVLS_ENABLE stays off unless the operator names it.
    assert RayStackConfig(trainer_env="NCCL_NVLS_ENABLE=1").rank_env() == {"NCCL_NVLS_ENABLE": "1"}


@pytest.mark.parametrize("fields, field, reason", [
    ({"trainer_world_size": 2}, "trainer_rendezvous_port", "required with trainer_world_size 2"),
    ({"trainer_world_size": 2, "trainer_rendezvous_port": 29400, "trainer_gpus": 1}, "trainer_gpus",
     "give trainer_gpus_per_rank instead"),
    ({"trainer_world_size": 2, "trainer_rendezvous_port": 29400, "trainer_args": "--device cuda"}, "trainer_args",
     "--device is set by the launcher"),
    ({"trainer_world_size": 2, "trainer_rendezvous_port": 50052}, "trainer_rendezvous_port",
     "port 50052 is also trainer_port's"),
    ({"trainer_env": "LD_PRELOAD=/x.so"}, "trainer_env", "NCCL_*, GLOO_* or TORCH_NCCL_*"),
    ({"trainer_env": "NCCL_DEBUG"}, "trainer_env", "is not NAME=VALUE"),
    ({"trainer_placement_strategy": "RANDOM"}, "trainer_placement_strategy", "PACK"),
    ({"trainer_port": 8000}, "trainer_port", "port 8000 is also coordinator_port's"),
    ({"rollout_replicas": 3, "rollout_port_base": 50050}, "rollout_port_base", "port 50052 is also trainer_port's"),
    ({"rollout_replicas": 2, "rollout_port_base": 65535}, "rollout_port_base", "above 65535"),
    ({"trainer_broadcast_port": 65536}, "trainer_broadcast_port", "less than or equal to 65535"),
    ({"trainer_broadcast_port": -1}, "trainer_broadcast_port", "greater than or equal to 0"),
    ({"trainer_broadcast_port": 50052}, "trainer_broadcast_port", "port 50052 is also trainer_port's"),
    ({"trainer_broadcast_port": 9102}, "trainer_broadcast_port", "port 9102 is also trainer_metrics_port's"),
    ({"trainer_broadcast_port": 8000}, "trainer_broadcast_port", "port 8000 is also coordinator_port's"),
    ({"trainer_broadcast_port": 29500, "rollout_replicas": 2, "rollout_port_base": 29499}, "rollout_port_base",
     "port 29500 is also trainer_broadcast_port's"),
    ({"trainer_broadcast_port": 29500, "rollout_metrics_port_base": 29500}, "rollout_metrics_port_base",
     "port 29500 is also trainer_broadcast_port's"),
    ({"trainer_broadcast_port": 29500, "trainer_args": "--weight-broadcast-address=10.0.0.1:29501"}, "trainer_args",
     "--weight-broadcast-address is set by the launcher from trainer_broadcast_port"),
    ({"trainer_broadcast_port": 29500, "rollout_args": ["--broadcast-sources", "10.0.0.1:29501"]}, "rollout_args",
     "--broadcast-sources is set by the launcher from trainer_broadcast_port"),
    ({"placement_strategy": "RANDOM"}, "placement_strategy", "PACK"),
    ({"rollout_replicas": 0}, "rollout_replicas", "greater than or equal to 1"),
])
def test_bad_config_names_the_field(fields, field, reason):
    with pytest.raises(ValidationError) as err:
        RayStackConfig(**fields)
    assert field in str(err.value) and reason in str(err.value)


def test_a_service_started_by_an_actor_draws_ports_from_the_half_its_node_process_never_does():
    cfg = RayStackConfig(rollout_replicas=1)
    trainer = plan_workers(cfg)[0]
    env = actor_env({"PATH": "/bin", SLICE_ENV: "0/4"}, trainer, "/shared/token")
    assert env[SLICE_ENV] == "0/4,1/2" and env[TOKEN_FILE_ENV] == "/shared/token" and env["PATH"] == "/bin"
    assert all(env[k] == v for k, v in trainer.env)  # the plan's own settings on top
    assert actor_env({"PATH": "/bin"}, trainer, "/t")[SLICE_ENV] == "1/2"  # a cluster's node: the upper half

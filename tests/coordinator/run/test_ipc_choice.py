"""Whether a run's weights go over IPC: from what the trainer and each replica report of where they run."""
from __future__ import annotations

import pytest

from services.coordinator.ipc_weights import choose_source, ipc_blocker
from services.coordinator.run.errors import RunFailed

NODE = "boot-1/ipc:[4026531839]"
GPU0, GPU1 = "GPU-aaaa", "GPU-bbbb"
TRAINER = {"node_id": NODE, "hostname": "h1", "device_uuids": f"{GPU0},{GPU1}", "weights_device_uuid": GPU0}


def replica(node: str = NODE, devices: str = f"{GPU0},{GPU1}", host: str = "h1") -> dict[str, str]:
    return {"node_id": node, "hostname": host, "device_uuids": devices, "weights_device_uuid": GPU1}


def test_one_node_and_the_trainers_gpu_in_sight_is_ipc():
    assert ipc_blocker("torch", TRAINER, replica(), "r:1") is None
    assert ipc_blocker("torch", TRAINER, replica(devices=GPU0), "r:1") is None
    choice = choose_source("auto", "grpc", "torch", TRAINER, {"r:1": replica(), "r:2": replica(devices=GPU0)})
    assert choice.source == "ipc" and NODE in choice.reason and GPU0 in choice.reason
    # A trainer on CPU shares host memory: any replica of its node can map it.
    cpu = {**TRAINER, "weights_device_uuid": ""}
    assert choose_source("ipc", "grpc", "torch", cpu, {"r:1": replica(devices="")}).source == "ipc"


def test_another_node_another_namespace_or_an_unseen_gpu_falls_back_naming_why():
    cases = {
        "r:1": (replica(node="boot-2/ipc:[4026531839]", host="h2"), "runs on h2"),
        "r:2": (replica(node="boot-1/ipc:[4026532000]"), "IPC namespace"),
        "r:3": (replica(devices=GPU1), f"does not see the trainer's GPU {GPU0}"),
        "r:4": ({}, "an unreported host"),
    }
    for address, (details, reason) in cases.items():
        blocker = ipc_blocker("torch", TRAINER, details, address)
        assert blocker is not None and reason in blocker and address in blocker
        choice = choose_source("auto", "shared_path", "torch", TRAINER, {"r:0": replica(), address: details})
        assert choice.source == "shared_path" and reason in choice.reason
    assert "another process" in ipc_blocker("sglang", TRAINER, replica(), "r:1")
    assert "no node identity" in ipc_blocker("torch", {}, replica(), "r:1")
    assert choose_source("auto", "grpc", "torch", TRAINER, {}).reason == "no replica answered"


def test_explicit_ipc_on_a_fleet_it_cannot_reach_fails_the_run_naming_the_replica():
    with pytest.raises(RunFailed, match=r"rollout.weight_sync: 'ipc' cannot reach the fleet: replica r:2 runs on h2"):
        choose_source("ipc", "grpc", "torch", TRAINER, {"r:1": replica(), "r:2": replica(node="boot-9/x", host="h2")})

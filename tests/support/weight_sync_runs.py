"""The short run and the sync records that the weight-source stack tests compare across weight_sync values."""
from __future__ import annotations

from pathlib import Path


def sync_spec(model: Path, name: str, weight_sync: str) -> dict:
    """A 3-step run of `model` whose replicas get each version over `weight_sync`."""
    return {"name": name, "model_path": str(model), "seed": 5, "steps": 3,
            "task": {"name": "arithmetic", "options": {"heldout_size": 4}},
            "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4, "sampling": {"max_new_tokens": 4},
                        "weight_sync": weight_sync},
            "eval": {"every": 0, "heldout_size": 4}}


def run_events(client, run_id: str, name: str) -> list[dict]:
    return [e for e in client.run(run_id)["events"] if e["event"] == name]


def synced(client, run_id: str) -> list[tuple[int, str, int, list[str]]]:
    """(policy_version, digest, bytes, replicas) of each weights_synced event of the run."""
    return [(e["policy_version"], e["digest"], e["bytes"], e["replicas"])
            for e in run_events(client, run_id, "weights_synced")]

"""The rollout service in role scorer, with faults a test injects: `python -m tests.support.hostile_scorer
--faults FILE <rollout flags>` runs the real service, whose Score answers are corrupted as FILE says. The
production service has no such switch.

FILE is JSON, read at every Score call (a missing file: no faults), so one process serves the faults of
several tests in turn: {"faults": {"<item_id>": {"kind": K, "times": N}}, "hang_s": S}. An item with a fault
has it injected in the first N Score calls of that run that carry it; K is one of
- "nan", "inf": its score is NaN / +inf; "out_of_range": 1e6;
- "garbage": its result carries verdict text where a reward model's score belongs;
- "hang": the whole call sleeps S seconds before it is served (past the coordinator's deadline);
- "die": the process exits (137, as if SIGKILLed) while serving the call.
Every injection is appended to FILE + ".injected.jsonl" as {"run_id", "call_id", "item_id", "kind"} before it
takes effect, for "hang" and "die" once per item of the call: the counts a test compares with the
coordinator's counters.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import threading
from pathlib import Path

import services.rollout.server as rollout_server
from services.rollout.__main__ import main as rollout_main
from services.rollout.scorer.role import ScorerRole

CALL_FAULTS = ("hang", "die")


class Faults:
    def __init__(self, path: Path) -> None:
        self.path, self.log = path, Path(str(path) + ".injected.jsonl")
        self.used: dict[tuple[str, str], int] = {}
        self.lock = threading.Lock()

    def take(self, request) -> dict[str, str]:
        """The faults this call injects, by item id (counted as used)."""
        try:
            table = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        out = {}
        with self.lock:
            for item in request.items:
                fault = table.get("faults", {}).get(item.item_id)
                key = (request.run_id, item.item_id)
                if fault and self.used.get(key, 0) < fault.get("times", 1):
                    self.used[key] = self.used.get(key, 0) + 1
                    out[item.item_id] = fault["kind"]
            call_level = next((k for k in out.values() if k in CALL_FAULTS), None)
            if call_level is not None:  # the whole call fails: each of its items fails once
                out = {item.item_id: call_level for item in request.items}
            with open(self.log, "a") as f:
                for item_id, kind in out.items():
                    f.write(json.dumps({"run_id": request.run_id, "call_id": request.call_id, "item_id": item_id,
                                        "kind": kind}) + "\n")
        return out

    def hang_s(self) -> float:
        return float(json.loads(self.path.read_text()).get("hang_s", 30.0))


def install(faults: Faults) -> None:
    """Faults are taken (and logged) as a call arrives, before it waits for the engine, as a stuck or dying
    model would fail; the values are corrupted after the real model scored."""
    injected_by_call: dict[str, dict[str, str]] = {}

    class HostileScorerRole(ScorerRole):
        def score(self, request):
            injected = injected_by_call.pop(request.call_id, {})
            response = super().score(request)
            values = {"nan": math.nan, "inf": math.inf, "out_of_range": 1e6}
            for result in response.results:
                kind = injected.get(result.item_id)
                if kind in values:
                    result.score = values[kind]
                elif kind == "garbage":
                    result.score, result.verdict = 0.0, "\x00garbage\x00"
            return response

    rollout_server.ScorerRole = HostileScorerRole
    serve_score = rollout_server.RolloutServicer.Score

    async def hostile_score(self, request, context):
        injected = faults.take(request)
        if "die" in injected.values():
            os._exit(137)
        if "hang" in injected.values():
            await asyncio.sleep(faults.hang_s())  # cancelled by the caller's deadline, or served late
            injected = {}
        injected_by_call[request.call_id] = injected
        return await serve_score(self, request, context)

    rollout_server.RolloutServicer.Score = hostile_score


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hostile_scorer")
    parser.add_argument("--faults", required=True, type=Path)
    args, rollout_argv = parser.parse_known_args(argv)
    install(Faults(args.faults))
    rollout_main(rollout_argv)


if __name__ == "__main__":
    main(sys.argv[1:])

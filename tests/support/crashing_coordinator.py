"""The coordinator, with one fault for tests: `python -m tests.support.crashing_coordinator
--crash-after-train-step N <coordinator flags>` runs the real coordinator, whose process exits
abruptly (137, as if SIGKILLed) right after the trainer applied step N and before the step is
recorded -- the window a replay must cover. The production coordinator has no such switch."""
from __future__ import annotations

import argparse
import os
import sys

from services.coordinator.__main__ import main as coordinator_main
from services.coordinator.clients import TrainerClient


def die_after_train_step(step: int) -> None:
    """From now on, the process exits the moment the trainer reports step `step` applied (not replayed)."""
    train_step = TrainerClient.train_step

    async def train_step_then_die(self, header, trajectories):
        result = await train_step(self, header, trajectories)
        if header.step == step and not result.replayed:
            os._exit(137)
        return result

    TrainerClient.train_step = train_step_then_die


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="crashing_coordinator")
    parser.add_argument("--crash-after-train-step", type=int, required=True)
    args, coordinator_argv = parser.parse_known_args(argv)
    die_after_train_step(args.crash_after_train_step)
    coordinator_main(coordinator_argv)


if __name__ == "__main__":
    main(sys.argv[1:])

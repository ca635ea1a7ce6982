"""The coordinator, with broken experiment trackers for tests: `python -m tests.support.faulty_tracker_coordinator
--raising tensorboard --hanging mlflow <coordinator flags>` runs the real coordinator, in which the tracker
named by --raising raises from every call and the one named by --hanging never returns from any call after
it is built. The production coordinator has no such switch."""
from __future__ import annotations

import argparse
import sys
import threading

from services.coordinator.__main__ import main as coordinator_main
from services.coordinator.tracking import trackers


class RaisingTracker:
    def __init__(self, run, targets) -> None:
        pass

    def config(self, *args) -> None:
        raise RuntimeError("tracker down (injected)")

    metrics = samples = close = config  # type: ignore[assignment]


class HangingTracker:
    def __init__(self, run, targets) -> None:
        self._never = threading.Event()

    def config(self, *args) -> None:
        self._never.wait()

    metrics = samples = close = config  # type: ignore[assignment]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="faulty_tracker_coordinator")
    parser.add_argument("--raising", choices=sorted(trackers.TRACKERS), default=None)
    parser.add_argument("--hanging", choices=sorted(trackers.TRACKERS), default=None)
    args, coordinator_argv = parser.parse_known_args(argv)
    if args.raising:
        trackers.TRACKERS[args.raising] = RaisingTracker
    if args.hanging:
        trackers.TRACKERS[args.hanging] = HangingTracker
    coordinator_main(coordinator_argv)


if __name__ == "__main__":
    main(sys.argv[1:])

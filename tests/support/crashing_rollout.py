"""The rollout service, with one fault for tests: `python -m tests.support.crashing_rollout
--crash-on-receive-weights N <rollout flags>` runs the real rollout service, whose process exits abruptly
(137, as if SIGKILLed) when a ReceiveWeights of policy version N is about to join its weight-update group:
a replica lost in the middle of a broadcast sync, after it answered Info. The production service has no
such switch."""
from __future__ import annotations

import argparse
import os
import sys

import services.rollout.server as rollout_server
from services.rollout.__main__ import main as rollout_main


def die_on_receive(version: int) -> None:
    """From now on, the process exits the moment it is to receive the broadcast of `version`."""
    receive = rollout_server.receive_broadcast

    def receive_or_die(request, *args, **kwargs):
        if request.plan.policy_version == version:
            os._exit(137)
        return receive(request, *args, **kwargs)

    rollout_server.receive_broadcast = receive_or_die


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="crashing_rollout")
    parser.add_argument("--crash-on-receive-weights", type=int, required=True)
    args, rollout_argv = parser.parse_known_args(argv)
    die_on_receive(args.crash_on_receive_weights)
    rollout_main(rollout_argv)


if __name__ == "__main__":
    main(sys.argv[1:])

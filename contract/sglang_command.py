"""The SGLang server's command line and environment, as a rollout replica starts it: pure, no torch.

The rollout service (services/rollout/sglang/server.py) starts the server
with exactly these; `lockstep recipe show` prints them for a run spec, so
what it prints is what a rollout would run. Only the values decided when a
server starts differ: the rollout's pid, a free port, the generated API key.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from contract.command_line import (
    FLAG_PATTERN,
    SpecOption,
    chosen_switches,
    command_line_fields,
    render_spec_options,
    spec_option,
)
from contract.engine_options import SGLangEngineConfig

# Variables that would change what the server reports, removed from its
# environment: SGLANG_RETURN_ORIGINAL_LOGPROB=1 makes /generate return
# log-probs of the *unscaled* logits, not the temperature-scaled distribution
# the trainer recomputes (see services/rollout/sglang/client.py).
SCRUBBED_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "SGLANG_USE_CPU_ENGINE")
API_KEY_ENV = "LOCKSTEP_SGLANG_API_KEY"
"""How the bootstrap receives the server's --api-key: the environment is readable by the same user only,
a command line by everyone on the host."""


class LaunchPlan(Protocol):
    """What the platform decides about a server (services.common.platform.SGLangLaunchPlan): constant
    flags, the run's options it places, and the environment changes it needs."""

    @property
    def flags(self) -> tuple[str, ...]: ...

    @property
    def options(self) -> tuple[SpecOption, ...]: ...

    def child_env(self, base: Mapping[str, str]) -> dict[str, str]: ...


# The child's entry point: SGLang's own launcher, plus a watchdog thread that
# takes the server's process group down when the rollout service that started
# it is gone (getppid() changes on reparenting). The rollout's atexit hook and
# SGLangServer.stop() cover an orderly exit; this covers a rollout service that
# was SIGKILLed or crashed, which would otherwise leave a server holding GBs of
# memory and its port.
# (PR_SET_PDEATHSIG is no substitute: it fires when the launching *thread*
# exits, and servers are launched from worker and restart threads.)
# The bootstrap also hands SGLang its --api-key from the environment: arguments
# set in sys.argv here never appear in /proc/<pid>/cmdline. As one `--api-key=KEY`
# argument: a URL-safe key may start with '-', which argparse would otherwise take
# for an option and refuse the server's start.
BOOTSTRAP = (
    "import os, runpy, signal, sys, threading, time\n"
    "parent = int(sys.argv.pop(1))\n"
    f"sys.argv.append('--api-key=' + os.environ.pop({API_KEY_ENV!r}))\n"
    "def watch():\n"
    "    while os.getppid() == parent:\n"
    "        time.sleep(1.0)\n"
    "    os.killpg(0, signal.SIGTERM)\n"
    "    time.sleep(10.0)\n"
    "    os.killpg(0, signal.SIGKILL)\n"
    "threading.Thread(target=watch, name='lockstep-parent-watch', daemon=True).start()\n"
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)\n"
)


def engine_run_options(config: SGLangEngineConfig) -> tuple[SpecOption, ...]:
    """The run's engine options outside `server` that become server flags: every field that declares one,
    except those left None (the server's own default, nothing passed)."""
    return tuple(spec_option(config, name, "engine_config.") for name in command_line_fields(type(config))
                 if getattr(config, name) is not None)


def engine_switches(config: SGLangEngineConfig) -> tuple[str, ...]:
    """The code's constant switches the run turned on (boolean options declaring `server_switch`)."""
    return chosen_switches(config)


def server_command(
    python: str,
    plan: LaunchPlan,
    *,
    model_path: str,
    host: str,
    port: int,
    weight_version: str,
    run_options: Sequence[SpecOption] = (),
    switches: Sequence[str] = (),
    extra_args: Sequence[str] = (),
    parent_pid: int,
) -> list[str]:
    """The full command line. Pure, so a test can pin it.

    The one place the server's command line is built. What the operator and
    this code decide (`host`, `port`, `weight_version`, `plan.flags`,
    `extra_args`) is taken as is; what a run chose (`model_path`,
    `plan.options`, `run_options`) goes through render_spec_options, which
    refuses, naming the field, any value that could read as an option
    (contract/command_line.py): a new option cannot reach the command line
    without that check.

    --skip-tokenizer-init: the engine speaks token ids only (prompts arrive
    tokenized, samples leave as ids), so the server needs no tokenizer and
    does no detokenization work.
    """
    chosen = render_spec_options([SpecOption("model_path", "--model-path", model_path), *plan.options, *run_options])
    for switch in switches:  # the code's flags (engine_switches): checked as flag names, never values
        if not FLAG_PATTERN.fullmatch(switch):
            raise ValueError(f"{switch!r} is not a flag name")
    return [
        python, "-c", BOOTSTRAP, str(parent_pid),
        f"--host={host}",
        f"--port={port}",
        f"--weight-version={weight_version}",
        "--skip-tokenizer-init",
        *plan.flags,
        *chosen,
        *switches,
        *extra_args,
    ]


def server_env(plan: LaunchPlan, base: Mapping[str, str], api_key: str) -> dict[str, str]:
    """The server's environment: `base` without SCRUBBED_ENV, with the plan's changes, plus the server's
    API key for the bootstrap."""
    env = {k: v for k, v in base.items() if k not in SCRUBBED_ENV}
    return {**plan.child_env(env), API_KEY_ENV: api_key}

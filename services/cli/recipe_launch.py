"""The launch commands a resolved recipe implies: compose, the SGLang server the rollout starts, environments.

Printed by `lockstep recipe show` and `--dry-run`, and pinned by snapshot
tests. The SGLang command line and its environment come from the code the
rollout builds them with (services.common.platform.sglang_launch_plan,
contract.sglang_command.server_command / server_env), so what is printed is
what the rollout service would run; only values decided when it runs (its
pid, a free port, the generated --api-key) are shown as placeholders.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from contract.engine_options import SGLangEngineConfig
from contract.sglang_command import BOOTSTRAP, engine_run_options, engine_switches, server_command, server_env
from services.common.platform import Platform, sglang_launch_plan

COMPOSE_FILES: dict[Platform, tuple[str, ...]] = {
    Platform.ROCM: ("deploy/docker-compose.yml",),
    Platform.CUDA: ("deploy/docker-compose.yml", "deploy/docker-compose.nvidia.yml"),
}
"""The compose files per platform (deploy/README.md); a CPU host runs services.local_stack instead."""
COMPOSE_MODELS_MOUNT = "/models"
"""Where deploy/docker-compose.yml mounts LOCKSTEP_MODELS_DIR in the coordinator, rollout and trainer."""

SGLANG_PYTHON = "<sglang_python setting>"
BOOTSTRAP_SHOWN = "<bootstrap: runpy sglang.launch_server, stops with the rollout>"
PARENT_PID_SHOWN = "<rollout pid>"
HOST_SHOWN = "<sglang_host setting>"
PORT_SHOWN = "<sglang_port setting, 0: a free port>"
API_KEY_SHOWN = "<generated per engine>"
START_FROM_SHOWN = "<checkpoint_of_start_from.run>"
"""The SGLang model path of a run started from another run's checkpoint: the coordinator resolves it at submit."""


def device_env(platform: Platform, gpus: str) -> dict[str, str]:
    """The device selection compose gives a GPU service: HIP_VISIBLE_DEVICES on ROCm (deploy/docker-compose.yml;
    the NVIDIA override keeps it and adds CUDA_VISIBLE_DEVICES with the same host indices)."""
    if platform is Platform.ROCM:
        return {"HIP_VISIBLE_DEVICES": gpus}
    if platform is Platform.CUDA:
        return {"HIP_VISIBLE_DEVICES": gpus, "CUDA_VISIBLE_DEVICES": gpus}
    return {}


def compose_command(platform: Platform, *, models_dir: str, trainer_gpus: str, rollout_gpus: str) -> list[str] | None:
    """`VAR=... docker compose -f ... up -d` for the platform, or None on CPU (no compose stack there)."""
    files = COMPOSE_FILES.get(platform)
    if files is None:
        return None
    env = [f"LOCKSTEP_MODELS_DIR={models_dir}", f"LOCKSTEP_TRAINER_GPUS={trainer_gpus}",
           f"LOCKSTEP_ROLLOUT_GPUS={rollout_gpus}"]
    return [*env, "docker", "compose", *(a for f in files for a in ("-f", f)), "up", "-d"]


@dataclass(frozen=True)
class SGLangLaunch:
    platform: Platform
    argv: list[str]
    env_added: dict[str, str] = field(default_factory=dict)
    """Variables the rollout sets (or changes) for the server beyond the rollout container's own."""


def sglang_launch(spec: dict, platform: Platform, rollout_gpus: str) -> SGLangLaunch | None:
    """The SGLang server a rollout replica starts for this spec, or None when the engine is not SGLang.

    engine_options.platform wins over `platform` unless it is 'auto' (which the rollout resolves by probing
    its own torch); ValueError names a bad option as the API would.
    """
    rollout = spec.get("rollout") or {}
    if rollout.get("engine") != "sglang":
        return None
    config = SGLangEngineConfig.model_validate(rollout.get("engine_options") or {})
    chosen = platform if config.platform == "auto" else Platform(config.platform)
    base = device_env(chosen, rollout_gpus)
    plan = sglang_launch_plan(chosen, config.server, base)
    argv = server_command(
        SGLANG_PYTHON, plan, model_path=str(spec.get("model_path") or START_FROM_SHOWN), host=HOST_SHOWN, port=0,
        weight_version="0", run_options=engine_run_options(config), switches=engine_switches(config),
        parent_pid=0,
    )
    at = argv.index(BOOTSTRAP)
    argv[at], argv[at + 1] = BOOTSTRAP_SHOWN, PARENT_PID_SHOWN
    argv[argv.index("--port=0")] = f"--port={PORT_SHOWN}"
    # The rollout also withholds Lockstep's own token from the server; `base` holds none, and what is
    # shown is only what the rollout adds or changes.
    env = server_env(plan, base, api_key=API_KEY_SHOWN)
    added = {k: v for k, v in env.items() if base.get(k) != v}
    return SGLangLaunch(platform=chosen, argv=argv, env_added=added)


def _shell(argv: list[str]) -> str:
    """One flag (with its value) per line, as a shell would take it."""
    lines, current = [], []
    for arg in argv:
        if arg.startswith("--") and current:
            lines.append(shlex.join(current))
            current = []
        current.append(arg)
    lines.append(shlex.join(current))
    return " \\\n    ".join(lines)


def render_launch(spec: dict, platform: Platform, *, models_dir: str, served_models_dir: str, trainer_gpus: str,
                  rollout_gpus: str) -> str:
    """The launch section of `recipe show` / `--dry-run`: compose, service device environments, SGLang."""
    out = [f"## launch ({platform.value})"]
    compose = compose_command(platform, models_dir=models_dir, trainer_gpus=trainer_gpus, rollout_gpus=rollout_gpus)
    if compose is None:
        out.append("compose: none on cpu (python -m services.local_stack-style processes: README, 'Going further')")
    else:
        out.append("compose (from the repository root):")
        out.append("  " + shlex.join(compose))
        if served_models_dir != COMPOSE_MODELS_MOUNT:
            out.append(f"  note: compose mounts LOCKSTEP_MODELS_DIR at {COMPOSE_MODELS_MOUNT}: for that stack pass "
                       f"--served-models-dir {COMPOSE_MODELS_MOUNT}, and a --data-dir inside the models directory "
                       f"with --served-data-dir under {COMPOSE_MODELS_MOUNT}")
    for name, gpus in (("trainer", trainer_gpus), ("rollout", rollout_gpus)):
        env = device_env(platform, gpus)
        out.append(f"{name} container env: " + (" ".join(f"{k}={v}" for k, v in env.items()) or "(none)"))
    launch = sglang_launch(spec, platform, rollout_gpus)
    if launch is None:
        out.append(f"SGLang server: none (rollout.engine is {(spec.get('rollout') or {}).get('engine', 'torch')!r})")
    else:
        out.append(f"SGLang server ({launch.platform.value}), launched by each rollout replica:")
        out.append("  " + _shell(launch.argv) + " \\\n    <sglang_extra_args setting>")
        out.append("SGLang server env, set by the rollout beyond its container's:")
        out += [f"  {k}={v}" for k, v in sorted(launch.env_added.items())]
    return "\n".join(out) + "\n"

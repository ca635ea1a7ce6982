"""deploy/docker-compose.yml (MI300) and its NVIDIA override, read structurally with PyYAML.

The files are validated against the official Compose JSON schema everywhere
(test_compose_schema.py), and by `docker compose config` where a compose
plugin exists (not on CI machines: that test skips, saying so). The
structural tests below run everywhere and check what the schema cannot: the
services' environment names real config fields with valid values, addresses
and scrape targets agree, GPU services get the AMD devices, and only the API
and Grafana are published.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.conftest import require
import yaml

from services.coordinator.config import CoordinatorConfig
from services.rollout.config import RolloutServiceConfig
from services.trainer.config import TrainerServiceConfig
from tests.conftest import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
NVIDIA = DEPLOY / "docker-compose.nvidia.yml"
LOCKSTEP = {"coordinator": CoordinatorConfig, "rollout": RolloutServiceConfig, "trainer": TrainerServiceConfig}
GPU_SERVICES = ("rollout", "trainer")
# Third-party images whose own entrypoint is the command (Grafana's runs the server).
DEFAULT_ENTRYPOINT = {"grafana"}


class _Reset:
    """Compose's `!reset` tag: the key is removed from the merged result."""


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!reset", lambda loader, node: _Reset())


def load(path) -> dict:
    return yaml.load(path.read_text(), Loader=_Loader)  # noqa: S506 - SafeLoader subclass


def interpolate(value):
    """Compose's ${VAR:-default} / ${VAR} with an empty environment: the defaults a fresh node gets."""
    if isinstance(value, str):
        def sub(m):
            if m.group(2) is None:
                raise AssertionError(f"{m.group(0)} has no default: `docker compose up` would need it set")
            return m.group(3)
        return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", sub, value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def merge(base, over):
    """Compose's override merge, as far as these files use it: mappings merge, !reset removes,
    environment merges by key, other values (lists included) replace."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            if isinstance(v, _Reset):
                out.pop(k, None)
            elif k in out:
                out[k] = merge(out[k], v)
            else:
                out[k] = v
        return out
    return over


def services(*files) -> dict:
    doc = load(files[0])
    for f in files[1:]:
        doc = merge(doc, load(f))
    return interpolate(doc)["services"]


@pytest.fixture(scope="module")
def svc() -> dict:
    return services(COMPOSE)


@pytest.fixture(scope="module")
def nvidia_svc() -> dict:
    return services(COMPOSE, NVIDIA)


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def service_config(name: str, service: dict):
    """The service's typed config as its process would parse it from this environment."""
    model = LOCKSTEP[name]
    prefix = f"LOCKSTEP_{name.upper()}_"
    env = env_of(service)
    fields = {k[len(prefix):].lower(): v for k, v in env.items() if k.startswith(prefix)}
    unknown = set(fields) - set(model.model_fields)
    # parse_service_config reads only known fields, so a misspelt variable would be silently ignored.
    assert not unknown, f"{name}: {sorted(prefix + u.upper() for u in unknown)} are not fields of {model.__name__}"
    return model.model_validate(fields)


# ------------------------------------------------------------------ shape --

def test_every_service_has_image_command_and_healthcheck(svc):
    assert set(svc) == {"redis", "coordinator", "rollout", "trainer", "prometheus", "grafana"}
    for name, s in svc.items():
        assert s.get("image") or s.get("build"), f"{name}: no image or build"
        assert s.get("command") or name in DEFAULT_ENTRYPOINT, f"{name}: no command"
        hc = s.get("healthcheck", {})
        assert hc.get("test") and not hc.get("disable"), f"{name}: no healthcheck"


def test_lockstep_services_run_their_module_from_the_one_image(svc):
    images = set()
    for name in LOCKSTEP:
        s = svc[name]
        assert s["command"][-2:] == ["-m", f"services.{name}"], s["command"]
        assert s["build"]["dockerfile"] == "deploy/docker/Dockerfile.rocm"
        assert (DEPLOY / s["build"]["context"] / s["build"]["dockerfile"]).is_file()
        images.add(s["image"])
    assert len(images) == 1, f"rollout and trainer must share one image (torch and kernels): {images}"


def test_gpu_services_get_amd_devices_and_visibility(svc):
    for name in GPU_SERVICES:
        s = svc[name]
        assert {"/dev/kfd", "/dev/dri"} <= set(s["devices"]), name
        groups = set(map(str, s["group_add"]))
        assert "video" in groups and "render" in groups, f"{name}: {groups}"
        assert s["ipc"] == "host" and "seccomp=unconfined" in s["security_opt"], name
        assert int(re.match(r"(\d+)gb", s["shm_size"]).group(1)) >= 16, name
        env = env_of(s)
        assert re.fullmatch(r"\d+(,\d+)*", env["HIP_VISIBLE_DEVICES"]), f"{name}: {env}"
        assert "ROCR_VISIBLE_DEVICES" not in env  # nests with HIP_VISIBLE_DEVICES
    # One GPU each by default, and not the same one.
    assert env_of(svc["rollout"])["HIP_VISIBLE_DEVICES"] != env_of(svc["trainer"])["HIP_VISIBLE_DEVICES"]
    for name in set(svc) - set(GPU_SERVICES):
        assert "devices" not in svc[name], f"{name} should not hold GPUs"


def test_only_api_and_grafana_are_published_on_loopback_by_default(svc):
    published = {name: s["ports"] for name, s in svc.items() if s.get("ports")}
    assert set(published) == {"coordinator", "grafana"}, published
    assert published["coordinator"] == ["127.0.0.1:8000:8000"]
    assert published["grafana"] == ["127.0.0.1:3000:3000"]


# ----------------------------------------------------------- configuration --

def test_service_environment_is_valid_config(svc):
    c = service_config("coordinator", svc["coordinator"])
    r = service_config("rollout", svc["rollout"])
    t = service_config("trainer", svc["trainer"])
    for cfg in (c, r, t):
        assert cfg.host == "0.0.0.0"  # reachable from the other containers
    assert c.redis_url == "redis://redis:6379/0"
    assert c.trainer_address == f"trainer:{t.grpc_port}"
    assert c.rollout_addresses == [f"rollout:{r.grpc_port}"]
    assert t.device == "cuda"
    # Published container port is the API's port.
    assert svc["coordinator"]["ports"][0].endswith(f":{c.port}")


def test_misspelt_environment_variable_is_caught(svc):
    bad = {**svc["trainer"], "environment": {**env_of(svc["trainer"]), "LOCKSTEP_TRAINER_GRPC_PROT": "1"}}
    with pytest.raises(AssertionError, match="GRPC_PROT"):
        service_config("trainer", bad)


def test_prometheus_scrapes_every_service_where_it_listens(svc):
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {j["job_name"]: t for j in prom["scrape_configs"] for sc in j["static_configs"] for t in sc["targets"]}
    c = service_config("coordinator", svc["coordinator"])
    r = service_config("rollout", svc["rollout"])
    t = service_config("trainer", svc["trainer"])
    assert targets["lockstep-coordinator"] == f"coordinator:{c.port}"
    assert targets["lockstep-rollout"] == f"rollout:{r.metrics_port}"
    assert targets["lockstep-trainer"] == f"trainer:{t.metrics_port}"
    # The SGLang child server listens where the rollout service's operator settings say (a run cannot choose).
    assert targets["sglang"] == f"rollout:{r.sglang_port}" and str(r.sglang_port) in svc["rollout"]["expose"]
    assert r.sglang_host == "0.0.0.0"
    mounts = svc["prometheus"]["volumes"]
    assert "./prometheus:/etc/prometheus:ro" in mounts  # rule_files: rules/*.yml resolves beside the config
    assert "--config.file=/etc/prometheus/prometheus.yml" in svc["prometheus"]["command"]


def test_healthchecks_call_the_services_on_their_ports(svc):
    r = service_config("rollout", svc["rollout"])
    t = service_config("trainer", svc["trainer"])
    c = service_config("coordinator", svc["coordinator"])
    assert svc["rollout"]["healthcheck"]["test"][-3:] == ["grpc", "rollout", f"127.0.0.1:{r.grpc_port}"]
    assert svc["trainer"]["healthcheck"]["test"][-3:] == ["grpc", "trainer", f"127.0.0.1:{t.grpc_port}"]
    assert svc["coordinator"]["healthcheck"]["test"][-1] == f"http://127.0.0.1:{c.port}/healthz"
    assert (DEPLOY / "docker" / "healthcheck.py").is_file()


def test_startup_order_waits_for_health(svc):
    deps = svc["coordinator"]["depends_on"]
    assert {k: v["condition"] for k, v in deps.items()} == {
        "redis": "service_healthy", "rollout": "service_healthy", "trainer": "service_healthy"}
    assert svc["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


# ---------------------------------------------------------------- volumes --

def _mounts(s: dict) -> dict[str, str]:
    """container path -> 'source[:ro]'."""
    out = {}
    for v in s.get("volumes", []):
        parts = v.split(":")
        out[parts[1]] = parts[0] + (":ro" if parts[2:] == ["ro"] else "")
    return out


def test_models_and_runs_are_shared_at_the_same_paths(svc):
    c = service_config("coordinator", svc["coordinator"])
    mounts = {name: _mounts(svc[name]) for name in LOCKSTEP}
    # model_path is validated by the coordinator and opened by rollout and trainer: one path everywhere.
    assert {m["/models"] for m in mounts.values()} == {"./models:ro"}
    # Checkpoints: the trainer writes under the coordinator's data_dir, the rollout loads them from disk.
    assert {m[c.data_dir] for m in mounts.values()} == {"./runs"}


def test_sglang_weight_sync_directory_is_on_the_runs_volume(svc):
    from services.rollout.sglang import config as sglang_config

    env = env_of(svc["rollout"])
    weights = env[sglang_config.WEIGHTS_DIR_ENV]
    assert any(weights.startswith(path + "/") for path, src in _mounts(svc["rollout"]).items()
               if not src.endswith(":ro")), f"{weights} is not on a writable volume"
    # The interpreter comes from the image (Dockerfile ENV), checked at build time there.
    for dockerfile in ("Dockerfile.rocm", "Dockerfile.cuda"):
        assert f"ENV {sglang_config.PYTHON_ENV}=" in (DEPLOY / "docker" / dockerfile).read_text()


def test_redis_keeps_an_append_only_file_on_a_volume(svc):
    r = svc["redis"]
    script = r["command"][-1]
    assert r["command"][:2] == ["sh", "-c"] and "redis-server - --appendonly yes" in script
    assert _mounts(r)["/data"] == "redis-data"
    assert "redis-data" in load(COMPOSE)["volumes"]


def test_redis_requires_the_secret_password_and_has_no_dangerous_commands(svc):
    from services.coordinator.state.embedded_redis import DISABLED_COMMANDS

    r, c = svc["redis"], svc["coordinator"]
    script = r["command"][-1]
    assert r["secrets"] == ["redis_password"]
    # The password is read from the secret into the configuration on stdin, never put on a command line.
    assert "printf 'requirepass %s\\n' \"$$(cat /run/secrets/redis_password)\"" in script
    assert "--requirepass" not in script
    renamed = re.search(r"for c in ([A-Z ]+); do", script).group(1).split()
    assert sorted(renamed) == sorted(DISABLED_COMMANDS)  # the same lock-down as the embedded Redis
    assert "redis_password" in r["healthcheck"]["test"][-1]  # an unauthenticated ping would fail
    cfg = service_config("coordinator", c)
    assert cfg.redis_password_file == "/run/secrets/redis_password" and "redis_password" in c["secrets"]


def test_every_lockstep_service_reads_the_auth_token_secret(svc):
    secrets = load(COMPOSE)["secrets"]
    assert secrets["lockstep_auth_token"]["file"].endswith("/auth_token")
    assert secrets["redis_password"]["file"].endswith("/redis_password")
    for name in LOCKSTEP:
        s = svc[name]
        assert "lockstep_auth_token" in s["secrets"], name
        assert env_of(s)["LOCKSTEP_AUTH_TOKEN_FILE"] == "/run/secrets/lockstep_auth_token", name


def test_services_accept_paths_only_under_the_mounted_volumes(svc):
    c, r, t = (service_config(n, svc[n]) for n in ("coordinator", "rollout", "trainer"))
    mounts = set(_mounts(svc["trainer"]))
    for roots in (c.model_roots, c.data_roots, r.model_roots, t.model_roots, t.checkpoint_roots):
        assert roots and set(roots) <= mounts, roots
    assert t.checkpoint_roots == ["/runs"]  # written there: never the read-only models volume


# ------------------------------------------------------------ NVIDIA nodes --

def test_nvidia_override_swaps_devices_and_image(nvidia_svc):
    for name in LOCKSTEP:
        s = nvidia_svc[name]
        assert s["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda" and s["image"] == "lockstep:cuda"
        assert (DEPLOY / s["build"]["context"] / s["build"]["dockerfile"]).is_file()
    for name in GPU_SERVICES:
        s = nvidia_svc[name]
        assert "devices" not in s and "group_add" not in s, f"{name}: AMD devices survive the override"
        (res,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert res["driver"] == "nvidia" and "gpu" in res["capabilities"]
        env = env_of(s)
        # Same host index for both variables, so HIP->CUDA bridging cannot point elsewhere.
        assert env["CUDA_VISIBLE_DEVICES"] == env["HIP_VISIBLE_DEVICES"], f"{name}: {env}"
        # Everything else (env, volumes, healthcheck) is inherited from the MI300 file.
        service_config(name, s)
        assert s["healthcheck"]["test"] and _mounts(s)["/models"] == "./models:ro"
    assert set(nvidia_svc) == set(services(COMPOSE))


def test_nvidia_override_uses_reset_not_empty_lists():
    # Compose merges `devices` by container path: an empty list in the override would keep
    # /dev/kfd from the base file, and Docker refuses to start a container naming a missing device.
    raw = NVIDIA.read_text()
    for name in GPU_SERVICES:
        block = load(NVIDIA)["services"][name]
        assert isinstance(block["devices"], _Reset), name
    assert "!reset" in raw


# ------------------------------------------------------ docker compose config --

MIN_COMPOSE = (2, 24)  # `!reset` in the NVIDIA override


def _compose_cmd() -> tuple[list[str] | None, str]:
    """A Compose v2 command new enough for these files, or None and why not."""
    why = "no `docker compose` plugin or docker-compose here"
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if not shutil.which(cmd[0]):
            continue
        r = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True, timeout=30)
        m = re.match(r"v?(\d+)\.(\d+)", r.stdout.strip())
        if r.returncode != 0 or not m:
            continue
        if tuple(map(int, m.groups())) >= MIN_COMPOSE:
            return cmd, ""
        why = f"{' '.join(cmd)} {r.stdout.strip()} is older than {'.'.join(map(str, MIN_COMPOSE))}"
    return None, why


@pytest.mark.docker
@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, NVIDIA]], ids=["mi300", "nvidia"])
def test_docker_compose_config(files, tmp_path):
    # CI deselects the `docker` marker: no Docker Compose >= 2.24 can be installed
    # there (the plugin ships only from GitHub); the structural tests above stand in.
    cmd, why = _compose_cmd()
    require(cmd is not None, why)
    args = [a for f in files for a in ("-f", str(f))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
    r = subprocess.run([*cmd, *args, "config", "-q"], cwd=DEPLOY, capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr

"""Place a Lockstep stack on a Ray cluster.

The trainer and every rollout replica get one bundle of a placement group (its
strategy decides how they spread over nodes) and one named Ray actor in it; the
actor runs the service's own entry point (`python -m services.trainer`, ...)
under a ServiceSupervisor, bound to its node's address on a fixed port. The
coordinator runs the same way on the node of the process that launched the
stack, and dials the others by those addresses. The rollouts are started once
the trainer is placed, allowed to pull weights from its address and, with
trainer_broadcast_port set, to join the broadcast rendezvous the trainer then
serves on its node's address.

Two layers of restart, so a crash anywhere is survived without a new address:
the supervisor restarts a service process that exits, and Ray restarts an
actor that dies (max_restarts) in the same bundle, hence on the same node with
the same ports. What a restart loses the services already recover from: the
coordinator evicts and re-admits rollout replicas and resumes a lost trainer
from the run's last checkpoint.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from services.common.auth import TOKEN_FILE_ENV, BearerToken, read_token_file, write_token_file
from services.local_stack import service_env
from services.ray_stack.config import RayStackConfig
from services.ray_stack.supervisor import ServiceSupervisor

log = logging.getLogger("lockstep.ray_stack")
RAY_INSTALL_HINT = "ray is not installed: pip install 'ray==2.60.0' (the version requirements.lock pins)"


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(RAY_INSTALL_HINT) from exc
    return ray


@dataclass(frozen=True)
class ServicePlan:
    """One service of the stack: what runs, on which port, in which placement-group bundle."""

    name: str          # Ray actor name in the stack's namespace
    module: str        # python -m <module>
    args: tuple[str, ...]  # its flags, except those naming the node's address (known only there)
    port: int          # the port other services dial
    num_cpus: float
    num_gpus: float
    bundle: int | None  # None: the launching node, outside the placement group
    broadcast_port: int = 0  # the trainer's weight-broadcast rendezvous on its node (0: none)


def node_argv(plan: ServicePlan, node_ip: str, python: str) -> list[str]:
    """The service's command line on the node it was placed on: its flags plus those naming that node's
    address (--host, and the trainer's --weight-broadcast-address). Pure: a test can pin it."""
    argv = [python, "-m", plan.module, "--host", node_ip, *plan.args]
    if plan.broadcast_port:
        argv += ["--weight-broadcast-address", f"{node_ip}:{plan.broadcast_port}"]
    return argv


def plan_workers(config: RayStackConfig) -> list[ServicePlan]:
    """Trainer and rollout replicas, bundle i for plan i. Pure: a test can pin it."""
    threads = ("--num-threads", str(config.num_threads))
    roots = config.roots()
    data_dir = str(Path(config.data_dir).resolve())
    plans = [ServicePlan(
        "trainer", "services.trainer",
        ("--grpc-port", str(config.trainer_port), "--metrics-port", str(config.trainer_metrics_port),
         *threads, "--model-roots", roots, "--checkpoint-roots", data_dir, *config.trainer_args),
        config.trainer_port, config.trainer_cpus, config.trainer_gpus, 0, config.trainer_broadcast_port,
    )]
    for i in range(config.rollout_replicas):
        metrics = config.rollout_metrics_port_base + i if config.rollout_metrics_port_base else 0
        plans.append(ServicePlan(
            f"rollout-{i}", "services.rollout",
            ("--grpc-port", str(config.rollout_port_base + i), "--metrics-port", str(metrics),
             *threads, "--model-roots", roots, *config.rollout_args),
            config.rollout_port_base + i, config.rollout_cpus, config.rollout_gpus, i + 1,
        ))
    return plans


def with_weight_source(rollouts: list[ServicePlan], trainer_address: str,
                       broadcast_address: str = "") -> list[ServicePlan]:
    """The rollout plans, allowed to pull weights from the placed trainer and, when it serves one, to join
    its weight-broadcast rendezvous (both addresses known only once it runs)."""
    sources = ("--weight-sources", trainer_address)
    if broadcast_address:
        sources += ("--broadcast-sources", broadcast_address)
    return [replace(p, args=(*p.args, *sources)) for p in rollouts]


def plan_coordinator(config: RayStackConfig, trainer: str, rollouts: list[str]) -> ServicePlan:
    data_dir = str(Path(config.data_dir).resolve())
    args = ["--port", str(config.coordinator_port), "--data-dir", data_dir,
            "--trainer-address", trainer, "--rollout-addresses", ",".join(rollouts),
            "--model-roots", config.roots(), "--data-roots", config.roots()]
    if config.redis_url:
        args += ["--redis-url", config.redis_url]
    return ServicePlan("coordinator", "services.coordinator", (*args, *config.coordinator_args),
                       config.coordinator_port, 0, 0, None)


def ensure_token_file(path: Path) -> BearerToken:
    """The stack's token: generated once into `path` (mode 0600), the same for every service and restart."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_token_file(path)
        except FileExistsError:  # another launcher wrote it first: use theirs
            pass
    return read_token_file(path)


def bundles(plans: list[ServicePlan]) -> list[dict[str, float]]:
    out = []
    for p in plans:
        b = {"CPU": p.num_cpus}
        if p.num_gpus:
            b["GPU"] = p.num_gpus
        out.append(b)
    return out


class ServiceActor:
    """Body of each Ray actor: supervise one service process on this node."""

    def __init__(self, plan: ServicePlan, log_dir: str, max_restarts: int, restart_delay_s: float,
                 token_file: str) -> None:
        import ray

        self.ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.plan = plan
        argv = node_argv(plan, self.ip, sys.executable)
        # The token travels as the path of its file on shared storage, never as a value through Ray.
        self.supervisor = ServiceSupervisor(
            argv, env={**service_env(os.environ), TOKEN_FILE_ENV: token_file},
            log_path=Path(log_dir) / f"{plan.name}.log",
            max_restarts=max_restarts, restart_delay_s=restart_delay_s,
        )
        self.supervisor.start()

    def describe(self) -> dict:
        status = asdict(self.supervisor.status())
        status["exit_codes"] = list(status["exit_codes"])  # the same as in the JSON line
        placed = {"address": f"{self.ip}:{self.plan.port}", "node_id": self.node_id, "actor_pid": os.getpid()}
        if self.plan.broadcast_port:
            placed["weight_broadcast_address"] = f"{self.ip}:{self.plan.broadcast_port}"
        return {**placed, **status}

    def stop(self, grace_s: float = 20.0) -> int | None:
        return self.supervisor.stop(grace_s)


class RayStack:
    """start() places and starts everything and waits for the coordinator's /readyz; close() undoes it."""

    def __init__(self, config: RayStackConfig) -> None:
        self.config = config
        self.ray = import_ray()
        self.actors: dict[str, object] = {}
        self.placement_group = None
        self.api_url = ""
        self.token_file = config.token_path()

    def connect(self) -> None:
        """Join (or, for 'local', start) the cluster. Ray installs its own SIGTERM handler here, one that
        aborts the process: an entry point sets its handlers after this."""
        cfg, ray = self.config, self.ray
        if cfg.ray_address == "local":
            ray.init(namespace=cfg.namespace, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=cfg.ray_address, namespace=cfg.namespace, log_to_driver=False)

    def start(self) -> dict:
        cfg, ray = self.config, self.ray
        if not ray.is_initialized():
            self.connect()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        ensure_token_file(self.token_file)
        workers = plan_workers(cfg)
        self.placement_group = ray.util.placement_group(bundles(workers), strategy=cfg.placement_strategy,
                                                        name=f"{cfg.namespace}-stack")
        try:
            ray.get(self.placement_group.ready(), timeout=cfg.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"placement_strategy: {cfg.placement_strategy} placement of {bundles(workers)} not possible within "
                f"{cfg.ready_timeout_s:.0f} s; the cluster has {ray.cluster_resources()}"
            ) from None
        log_dir = str(Path(cfg.data_dir).resolve() / "logs")
        remote = ray.remote(ServiceActor)
        trainer, rollouts = workers[0], workers[1:]
        self.actors[trainer.name] = self._spawn(remote, trainer, log_dir, PlacementGroupSchedulingStrategy(
            self.placement_group, placement_group_bundle_index=trainer.bundle))
        placed = {trainer.name: ray.get(self.actors[trainer.name].describe.remote(), timeout=cfg.ready_timeout_s)}
        broadcast_address = placed[trainer.name].get("weight_broadcast_address", "")
        for plan in with_weight_source(rollouts, placed[trainer.name]["address"], broadcast_address):
            self.actors[plan.name] = self._spawn(remote, plan, log_dir, PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=plan.bundle))
        placed.update({p.name: ray.get(self.actors[p.name].describe.remote(), timeout=cfg.ready_timeout_s)
                       for p in rollouts})
        coordinator = plan_coordinator(cfg, placed["trainer"]["address"],
                                       [placed[p.name]["address"] for p in workers[1:]])
        here = ray.get_runtime_context().get_node_id()
        self.actors["coordinator"] = self._spawn(remote, coordinator, log_dir,
                                                 NodeAffinitySchedulingStrategy(node_id=here, soft=False))
        placed["coordinator"] = ray.get(self.actors["coordinator"].describe.remote(), timeout=cfg.ready_timeout_s)
        self.api_url = f"http://{placed['coordinator']['address']}"
        self._wait_ready()
        ready = {"api_url": self.api_url, "token_file": str(self.token_file), "trainer": placed["trainer"]["address"],
                 "rollouts": [placed[p.name]["address"] for p in workers[1:]], "services": self.describe()}
        if broadcast_address:
            ready["weight_broadcast_address"] = broadcast_address
        return ready

    def _spawn(self, remote, plan: ServicePlan, log_dir: str, strategy):
        cfg = self.config
        return remote.options(
            name=plan.name, num_cpus=plan.num_cpus, num_gpus=plan.num_gpus, scheduling_strategy=strategy,
            max_restarts=cfg.service_restarts, max_task_retries=-1,
        ).remote(plan, log_dir, cfg.service_restarts, cfg.restart_delay_s, str(self.token_file))

    def _wait_ready(self) -> None:
        deadline, last = time.monotonic() + self.config.ready_timeout_s, ""
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{self.api_url}/readyz", timeout=5.0, trust_env=False)
                if r.status_code == 200:
                    return
                last = r.text
            except httpx.HTTPError as exc:
                last = str(exc)
            gone = {n: s for n, s in self.describe().items() if s["gave_up"]}
            if gone:
                raise RuntimeError(f"services exited during start-up and were not restarted: {json.dumps(gone)} "
                                   f"(logs under {Path(self.config.data_dir).resolve() / 'logs'})")
            time.sleep(0.5)
        raise RuntimeError(f"coordinator at {self.api_url} not ready within {self.config.ready_timeout_s:.0f} s: {last}")

    def describe(self) -> dict[str, dict]:
        return {name: self.ray.get(a.describe.remote(), timeout=60) for name, a in self.actors.items()}

    def close(self) -> None:
        ray = self.ray
        # Coordinator first, so no run is driven against services going away.
        for name in ["coordinator", *[n for n in self.actors if n != "coordinator"]]:
            actor = self.actors.pop(name, None)
            if actor is None:
                continue
            try:
                ray.get(actor.stop.remote(), timeout=60)
            except Exception as exc:  # a dead actor's service died with it (PDEATHSIG)
                log.warning("stopping %s: %s", name, exc)
            ray.kill(actor, no_restart=True)
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
        if ray.is_initialized():
            ray.shutdown()

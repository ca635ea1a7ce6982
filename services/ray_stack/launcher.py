"""Place a Lockstep stack on a Ray cluster.

Each trainer rank and each rollout replica gets one bundle of a placement group
(the trainer's ranks one group, the rollouts another; their strategies decide
how they spread over nodes) and one named Ray actor in it; the actor runs the
service's own entry point (`python -m services.trainer`, ...) under a
ServiceSupervisor, bound to its node's address on a fixed port. Trainer rank 0
('trainer') is placed first: it serves gRPC and, with several ranks, the
ranks' store on its node's address; ranks 1..N-1 are then started pointed at
that address. The coordinator runs the same way on the node of the process
that launched the stack, and dials the others by those addresses. The rollouts
are started once rank 0 is placed, beside ranks 1..N-1, allowed to pull weights
from rank 0's address and, with trainer_broadcast_port set, to join the
broadcast rendezvous rank 0 then serves on its node's address.

Two layers of restart, so a crash anywhere is survived without a new address:
the supervisor restarts a service process that exits, and Ray restarts an
actor that dies (max_restarts) in the same bundle, hence on the same node with
the same ports. What a restart loses the services already recover from: the
coordinator evicts and re-admits rollout replicas and resumes a lost trainer
from the run's last checkpoint. A trainer rank that dies takes every rank of
its group down with it (services/trainer/distributed/worker_group.py); their supervisors
restart them, they meet again at rank 0's store, and the coordinator resumes.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from services.common.auth import TOKEN_FILE_ENV, BearerToken, read_token_file, write_token_file
from services.common.process.ports import SLICE_ENV, child_port_slice
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
    bundle: int | None  # None: the launching node, outside the placement groups
    broadcast_port: int = 0  # the trainer's weight-broadcast rendezvous on its node (0: none)
    env: tuple[tuple[str, str], ...] = ()  # set on top of the node's environment


def node_argv(plan: ServicePlan, node_ip: str, python: str) -> list[str]:
    """The service's command line on the node it was placed on: its flags plus those naming that node's
    address (--host, and the trainer's --weight-broadcast-address). Pure: a test can pin it."""
    argv = [python, "-m", plan.module, "--host", node_ip, *plan.args]
    if plan.broadcast_port:
        argv += ["--weight-broadcast-address", f"{node_ip}:{plan.broadcast_port}"]
    return argv


def plan_trainer(config: RayStackConfig) -> list[ServicePlan]:
    """Trainer rank r in bundle r of the trainer's placement group: rank 0 serves gRPC (and, with several
    ranks, their store); ranks 1..N-1 still lack the store's address (`with_rendezvous`). Pure."""
    n, gpus = config.trainer_world_size, config.trainer_rank_gpus()
    data_dir = str(Path(config.data_dir).resolve())
    group: tuple[str, ...] = ()
    if n > 1:
        group = ("--data-parallel", str(n), "--rank-rendezvous-port", str(config.trainer_rendezvous_port),
                 "--device", "cuda" if gpus else "cpu")
    env = tuple(config.rank_env().items())
    rank0 = ServicePlan(
        "trainer", "services.trainer",
        ("--grpc-port", str(config.trainer_port), "--metrics-port", str(config.trainer_metrics_port),
         "--num-threads", str(config.num_threads), "--model-roots", config.roots(), "--checkpoint-roots",
         data_dir, *group, *config.trainer_args),
        config.trainer_port, config.trainer_cpus, gpus, 0, config.trainer_broadcast_port, env,
    )
    # The ranks import what rank 0's group names only when started allowing it: rank 0's own plugins.
    plugins = flag_value(config.trainer_args, "--attention-plugins")
    allowed = ("--attention-plugins", plugins) if plugins else ()
    ranks = [ServicePlan(f"trainer-rank-{r}", "services.trainer.distributed.rank", ("--rank", str(r), *allowed), 0,
                         config.trainer_cpus, gpus, r, 0, env) for r in range(1, n)]
    return [rank0, *ranks]


def flag_value(args: tuple[str, ...] | list[str], flag: str) -> str | None:
    """The value `args` give `flag` ('--flag v' or '--flag=v'; the last one wins, as argparse has it)."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(f"{flag}="):
            value = a.split("=", 1)[1]
    return value


def with_rendezvous(ranks: list[ServicePlan], rank0_ip: str, port: int) -> list[ServicePlan]:
    """Ranks 1..N-1, pointed at the store rank 0 serves on its node (known once it is placed)."""
    return [replace(p, args=(*p.args, "--rendezvous", f"{rank0_ip}:{port}")) for p in ranks]


def plan_rollouts(config: RayStackConfig) -> list[ServicePlan]:
    """Rollout replica i in bundle i of the rollouts' placement group. Pure: a test can pin it."""
    threads = ("--num-threads", str(config.num_threads))
    plans = []
    for i in range(config.rollout_replicas):
        metrics = config.rollout_metrics_port_base + i if config.rollout_metrics_port_base else 0
        plans.append(ServicePlan(
            f"rollout-{i}", "services.rollout",
            ("--grpc-port", str(config.rollout_port_base + i), "--metrics-port", str(metrics),
             *threads, "--model-roots", config.roots(), *config.rollout_args),
            config.rollout_port_base + i, config.rollout_cpus, config.rollout_gpus, i,
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


def actor_env(base: Mapping[str, str], plan: ServicePlan, token_file: str) -> dict[str, str]:
    """The environment of a service an actor starts: its node's, the plan's on top, the token's file, and the
    half of this process's port range it never draws from (ports.child_port_slice), so that ports the service
    picks itself (a trainer group's rendezvous, an embedded Redis) never collide with ones picked here or by
    the driver that shares this slice (a test, a LocalStack beside the Ray stack)."""
    return {**service_env(base), SLICE_ENV: child_port_slice(base), **dict(plan.env), TOKEN_FILE_ENV: token_file}


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
            argv, env=actor_env(os.environ, plan, token_file),
            log_path=Path(log_dir) / f"{plan.name}.log",
            max_restarts=max_restarts, restart_delay_s=restart_delay_s,
        )
        self.supervisor.start()

    def describe(self) -> dict:
        status = asdict(self.supervisor.status())
        status["exit_codes"] = list(status["exit_codes"])  # the same as in the JSON line
        address = f"{self.ip}:{self.plan.port}" if self.plan.port else self.ip  # a trainer rank > 0 serves nothing
        placed = {"address": address, "node_id": self.node_id, "actor_pid": os.getpid()}
        if self.plan.broadcast_port:
            placed["weight_broadcast_address"] = f"{self.ip}:{self.plan.broadcast_port}"
        return {**placed, **status}

    def hold(self) -> None:
        self.supervisor.hold()

    def stop(self, grace_s: float = 20.0) -> int | None:
        return self.supervisor.stop(grace_s)


class RayStack:
    """start() places and starts everything and waits for the coordinator's /readyz; close() undoes it."""

    def __init__(self, config: RayStackConfig) -> None:
        self.config = config
        self.ray = import_ray()
        self.actors: dict[str, object] = {}
        self.placement_groups: list = []
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
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        placed, ranks = self._start_trainer()
        rollouts = plan_rollouts(cfg)
        rollout_pg = self._placement_group(rollouts, cfg.placement_strategy, "placement_strategy",
                                           f"{cfg.namespace}-rollouts")
        broadcast_address = placed["trainer"].get("weight_broadcast_address", "")
        for plan in with_weight_source(rollouts, placed["trainer"]["address"], broadcast_address):
            self._spawn_in(plan, rollout_pg)
        # The trainer's other ranks and the rollouts need only rank 0's address: they start side by side.
        placed.update(self._describe([*ranks, *rollouts]))
        coordinator = plan_coordinator(cfg, placed["trainer"]["address"], [placed[p.name]["address"] for p in rollouts])
        here = ray.get_runtime_context().get_node_id()
        self.actors["coordinator"] = self._spawn(coordinator, NodeAffinitySchedulingStrategy(node_id=here, soft=False))
        placed["coordinator"] = ray.get(self.actors["coordinator"].describe.remote(), timeout=cfg.ready_timeout_s)
        self.api_url = f"http://{placed['coordinator']['address']}"
        self._wait_ready()
        ready = {"api_url": self.api_url, "token_file": str(self.token_file), "trainer": placed["trainer"]["address"],
                 "rollouts": [placed[p.name]["address"] for p in rollouts], "services": self.describe()}
        if broadcast_address:
            ready["weight_broadcast_address"] = broadcast_address
        return ready

    def place_trainer(self) -> dict[str, dict]:
        """Place and start the trainer's ranks (rank 0 first: the others need its node's address); what each
        rank's actor describes, by actor name. On its own it is a trainer without rollouts or coordinator."""
        placed, ranks = self._start_trainer()
        placed.update(self._describe(ranks))
        return placed

    def _start_trainer(self) -> tuple[dict[str, dict], list[ServicePlan]]:
        """Rank 0 placed, started and described (by actor name); ranks 1..N-1 started pointed at its node,
        their plans returned for the caller to describe once what it starts beside them is started too."""
        cfg, ray = self.config, self.ray
        if not ray.is_initialized():
            self.connect()
        ensure_token_file(self.token_file)
        ranks = plan_trainer(cfg)
        pg = self._placement_group(ranks, cfg.trainer_placement_strategy, "trainer_placement_strategy",
                                   f"{cfg.namespace}-trainer")
        self._spawn_in(ranks[0], pg)
        placed = self._describe(ranks[:1])
        rank0_ip = placed["trainer"]["address"].rsplit(":", 1)[0]
        others = with_rendezvous(ranks[1:], rank0_ip, cfg.trainer_rendezvous_port)
        for plan in others:
            self._spawn_in(plan, pg)
        return placed, others

    def _describe(self, plans: list[ServicePlan]) -> dict[str, dict]:
        """What each of these actors describes once started (they start side by side; one wait for all)."""
        refs = [self.actors[p.name].describe.remote() for p in plans]
        return dict(zip([p.name for p in plans], self.ray.get(refs, timeout=self.config.ready_timeout_s)))

    def _spawn_in(self, plan: ServicePlan, placement_group) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.actors[plan.name] = self._spawn(plan, PlacementGroupSchedulingStrategy(
            placement_group, placement_group_bundle_index=plan.bundle))

    def _placement_group(self, plans: list[ServicePlan], strategy: str, field: str, name: str):
        ray = self.ray
        pg = ray.util.placement_group(bundles(plans), strategy=strategy, name=name)
        self.placement_groups.append(pg)
        try:
            ray.get(pg.ready(), timeout=self.config.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"{field}: {strategy} placement of {bundles(plans)} not possible within "
                f"{self.config.ready_timeout_s:.0f} s; the cluster has {ray.cluster_resources()}"
            ) from None
        return pg

    def _spawn(self, plan: ServicePlan, strategy):
        cfg = self.config
        log_dir = str(Path(cfg.data_dir).resolve() / "logs")
        return self.ray.remote(ServiceActor).options(
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
        # No restarts from here on: trainer rank 0 stopping ends its other ranks, which would otherwise be
        # started again only to be stopped.
        self._call_each(self.actors, "hold", "holding")
        # Coordinator first, so no run is driven against services going away; then trainer rank 0 (which
        # stops the group, ending its other ranks) beside the rollouts; then what is left (those ranks).
        self._stop(["coordinator"])
        self._stop([n for n in self.actors if not n.startswith("trainer-rank-")])
        self._stop(list(self.actors))
        while self.placement_groups:
            ray.util.remove_placement_group(self.placement_groups.pop())
        if ray.is_initialized():
            ray.shutdown()

    def _stop(self, names: list[str]) -> None:
        """Stop these services side by side (each its graceful shutdown, see ServiceSupervisor.stop), then
        end their actors."""
        stopping = {name: self.actors.pop(name) for name in names if name in self.actors}
        self._call_each(stopping, "stop", "stopping")
        for actor in stopping.values():
            self.ray.kill(actor, no_restart=True)

    def _call_each(self, actors: dict, method: str, verb: str, timeout_s: float = 60) -> None:
        """Call `method` on every actor at once, then wait for each, up to `timeout_s`. A failure is logged,
        never raised: a dead actor's service died with it (PDEATHSIG), and closing goes on for the others."""
        calls = {}
        for name, actor in actors.items():
            try:
                calls[name] = getattr(actor, method).remote()
            except Exception as exc:  # noqa: BLE001 - logged; see the docstring
                log.warning("%s %s: %s", verb, name, exc)
        for name, ref in calls.items():
            try:
                self.ray.get(ref, timeout=timeout_s)
            except Exception as exc:  # noqa: BLE001 - logged; see the docstring
                log.warning("%s %s: %s", verb, name, exc)

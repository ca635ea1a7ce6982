"""REST API (FastAPI). Handlers are thin: validate, call the store, answer.

A Redis outage (after the store's retries) answers 503 with Retry-After, never
500: the request may be repeated once Redis is back, and nothing was half-stored
(each write is one transaction or script).

Every /v1 route requires the deployment's bearer token (401 with a JSON body
otherwise, before the request body is even parsed); /healthz, /readyz,
/metrics and the OpenAPI docs stay open. Run specs are validated against the
coordinator's model_roots and data_roots (run_spec.confined_run_spec).
"""

# No `from __future__ import annotations`: FastAPI reads the submit handler's body type, a class made
# per app (confined_run_spec), from its annotation, which must be the object, not a name to resolve.
import asyncio
import contextlib
import uuid
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.common.auth import BearerToken
from services.common.models import load_tokenizer
from services.coordinator.clients import RolloutClient, TrainerClient
from services.coordinator.config import CoordinatorConfig
from services.coordinator.embedded_redis import EmbeddedRedis
from services.coordinator.exporter import CoordinatorExporter
from services.coordinator.run_loop import RunDriver
from services.coordinator.run_spec import RunSpec, confined_run_spec
from services.coordinator.scheduler import RunScheduler
from services.coordinator.store import OUTAGE_ERRORS, STATUSES, RunStore


STORE_RETRY_AFTER_S = 5


def _field_errors(exc: RequestValidationError) -> list[dict]:
    out = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        out.append({"field": ".".join(loc) or "(body)", "reason": err.get("msg", "invalid")})
    return out


def _coordinator_id(data_dir: Path) -> str:
    """Stable identity of this coordinator's data dir: a restart re-takes its own leases at once."""
    path = data_dir / "coordinator.id"
    if not path.exists():
        path.write_text(uuid.uuid4().hex)
    return path.read_text().strip()


def redis_password(config: CoordinatorConfig) -> str | None:
    if not config.redis_password_file:
        return None
    try:
        return Path(config.redis_password_file).read_text().strip()
    except OSError as exc:
        raise ValueError(f"redis_password_file: cannot read it: {exc.strerror or exc}") from None


def bearer_dependency(token: BearerToken):
    """A FastAPI dependency answering 401 unless the request carries `token` (documented in the OpenAPI)."""
    scheme = HTTPBearer(auto_error=False, description="The deployment's shared token (services/common/auth.py).")

    async def require_token(credentials: HTTPAuthorizationCredentials | None = Depends(scheme)) -> None:
        if credentials is None or not token.matches(credentials.credentials):
            raise HTTPException(status_code=401, detail={"error": "missing or invalid bearer token"},
                                headers={"WWW-Authenticate": "Bearer"})

    return require_token


def create_app(config: CoordinatorConfig, token: BearerToken) -> FastAPI:
    data_dir = Path(config.data_dir).resolve()
    SubmittedRunSpec = confined_run_spec(config.model_roots, config.data_roots)
    password = redis_password(config)  # read before anything starts: a bad file fails the start

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        data_dir.mkdir(parents=True, exist_ok=True)
        redis = None
        redis_supervisor = None
        url, store_password = config.redis_url, password
        if not url:
            redis = EmbeddedRedis(data_dir / "redis").start()
            redis_supervisor = asyncio.create_task(redis.supervise(), name="embedded-redis-supervisor")
            url, store_password = redis.url, redis.password
        store = RunStore(url, password=store_password, retries=config.redis_retries,
                         backoff_max_s=config.redis_retry_backoff_max_s, socket_timeout_s=config.redis_socket_timeout_s)
        exporter = CoordinatorExporter()
        rollouts = [RolloutClient(a, config.rpc_timeout_s, token) for a in config.rollout_addresses]
        trainer = TrainerClient(config.trainer_address, config.rpc_timeout_s, token)

        def make_driver(run_id: str, spec: RunSpec, run_dir: Path) -> RunDriver:
            return RunDriver(run_id, spec, store, rollouts, trainer, exporter, run_dir,
                             config.generate_retries, load_tokenizer, config.crash_after_train_step,
                             trainer_recovery_timeout_s=config.trainer_recovery_timeout_s,
                             replica_recovery_timeout_s=config.replica_recovery_timeout_s)

        scheduler = RunScheduler(store, make_driver, data_dir, _coordinator_id(data_dir), exporter)
        app.state.store, app.state.exporter, app.state.scheduler = store, exporter, scheduler
        app.state.rollouts, app.state.trainer = rollouts, trainer
        scheduler.start()
        try:
            yield
        finally:
            await scheduler.stop()
            for c in [*rollouts, trainer]:
                await c.close()
            await store.close()
            if redis_supervisor is not None:
                redis_supervisor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await redis_supervisor
            if redis is not None:
                redis.stop()

    app = FastAPI(
        title="Lockstep coordinator", version="0.1.0", lifespan=lifespan,
        responses={503: {"description": "Run state (Redis) is unreachable; retry after Retry-After seconds."}},
    )

    async def _store_unavailable(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=503, headers={"Retry-After": str(STORE_RETRY_AFTER_S)},
                            content={"error": "run store unavailable", "reason": f"{type(exc).__name__}: {exc}"})

    for outage in OUTAGE_ERRORS:
        app.add_exception_handler(outage, _store_unavailable)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"error": "invalid request", "fields": _field_errors(exc)})

    def _store(request: Request) -> RunStore:
        return request.app.state.store

    async def _run_or_404(request: Request, run_id: str):
        run = await _store(request).get_run(run_id)
        if run is None:
            raise HTTPException(status_code=404, detail={"error": "run not found", "run_id": run_id})
        return run

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(bearer_dependency(token))],
                   responses={401: {"description": "Missing or invalid bearer token"}})

    @v1.post("/runs", status_code=201)
    async def submit_run(spec: SubmittedRunSpec, request: Request) -> dict:  # type: ignore[valid-type]
        run = await _store(request).create_run(spec.name, spec.model_dump_json(), spec.steps)
        request.app.state.scheduler.wake()
        return run.to_dict()

    @v1.get("/runs")
    async def list_runs(request: Request) -> dict:
        return {"runs": [r.to_dict() for r in await _store(request).list_runs()]}

    @v1.get("/runs/{run_id}")
    async def get_run(run_id: str, request: Request) -> dict:
        run = await _run_or_404(request, run_id)
        store = _store(request)
        spec = RunSpec.model_validate_json(await store.get_spec_json(run_id) or "{}").model_dump()
        latest = (await store.metrics(run_id))[-1:] or [None]
        return {**run.to_dict(), "spec": spec, "eval_initial": await store.get_aux(run_id, "eval_initial"),
                "latest": latest[0], "events": await store.events(run_id)}

    @v1.get("/runs/{run_id}/metrics")
    async def run_metrics(run_id: str, request: Request) -> dict:
        await _run_or_404(request, run_id)
        store = _store(request)
        return {"run_id": run_id, "eval_initial": await store.get_aux(run_id, "eval_initial"),
                "steps": await store.metrics(run_id)}

    @v1.post("/runs/{run_id}/cancel")
    async def cancel_run(run_id: str, request: Request) -> dict:
        await _run_or_404(request, run_id)
        if not await _store(request).set_status(run_id, "cancelled"):
            run = await _store(request).get_run(run_id)
            raise HTTPException(status_code=409, detail={"error": f"run is already {run.status}", "run_id": run_id})
        return (await _store(request).get_run(run_id)).to_dict()  # type: ignore[union-attr]

    app.include_router(v1)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        # The scheduler too: Redis may answer while the loop that drives runs cannot get on.
        checks = {"redis": await _store(request).ping(), "scheduler": request.app.state.scheduler.healthy}
        for c in [*request.app.state.rollouts, request.app.state.trainer]:
            try:
                checks[c.address] = (await c.health()).ok
            except Exception:
                checks[c.address] = False
        ok = all(checks.values())
        return JSONResponse(status_code=200 if ok else 503, content={"ready": ok, "checks": checks})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        try:
            runs = await _store(request).list_runs()
        except OUTAGE_ERRORS:
            pass  # the services' own metrics still answer during a Redis outage; run counts keep their last values
        else:
            request.app.state.exporter.run_counts({s: sum(r.status == s for r in runs) for s in STATUSES})
        return Response(generate_latest(request.app.state.exporter.registry), media_type=CONTENT_TYPE_LATEST)

    return app

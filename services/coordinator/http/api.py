"""REST API (FastAPI). Handlers are thin: validate, call the store, answer.

Every status code a route can answer is declared in its `responses`, so the
OpenAPI document (/openapi.json) is the whole contract; a schemathesis run
over it (tests/coordinator/test_openapi_contract.py) holds it to that.

A Redis outage (after the store's retries) answers 503 with Retry-After, never
500: the request may be repeated once Redis is back, and nothing was half-stored
(each write is one transaction or script).

Every /v1 route requires the deployment's bearer token (401 with a JSON body
otherwise, before the request body is even read); /healthz, /readyz,
/metrics and the OpenAPI docs stay open. Run specs are validated against the
coordinator's model_roots and data_roots (run_spec.confined_run_spec).
"""
# No `from __future__ import annotations`: FastAPI resolves the dependencies' annotations at runtime.
import asyncio
import contextlib
import json
import uuid
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from services.common.auth import BearerToken
from services.common.models.directory import load_tokenizer
from services.coordinator.clients import RolloutClient, TrainerClient
from services.coordinator.config import CoordinatorConfig
from services.coordinator.http.episode_views import episodes_router
from services.coordinator.http.run_exchange import ImportBody, exchange_router
from services.coordinator.run.loop import RunDriver, SpaceRetry
from services.coordinator.run.run_scheduler import RunScheduler
from services.coordinator.run_spec import (
    MAX_SPEC_BYTES,
    RunSpec,
    RunSpecError,
    confined_run_spec,
    parse_run_spec,
    validation_fields,
)
from services.coordinator.start_from import resolve_start_from
from services.coordinator.state.embedded_redis import EmbeddedRedis
from services.coordinator.state.exporter import CoordinatorExporter
from services.coordinator.state.store import OUTAGE_ERRORS, RUN_ID_PATTERN, STATUSES, RunStore, is_run_id
from services.coordinator.tracking.sample_routes import samples_router
from services.coordinator.tracking.trackers import TrackingTargets

STORE_RETRY_AFTER_S = 5


class FieldError(BaseModel):
    field: str = Field(..., description="Dotted path of the refused field ('(body)' for the spec as a whole).")
    reason: str = Field(..., description="Why it was refused.")


class InvalidRequestBody(BaseModel):
    error: str = Field(..., description="'invalid request'.")
    fields: list[FieldError] = Field(..., description="Every refused field; nothing was stored.")


class ErrorDetail(BaseModel):
    detail: dict[str, Any] = Field(..., description="`error` (what went wrong) and what it concerns (`run_id`).")


class RunRecordBody(BaseModel):
    id: str = Field(..., description="Run id (12 hex digits).")
    name: str = Field(..., description="The spec's name.")
    status: str = Field(..., description="pending, running, paused (waiting for POST .../resume: `error` says "
                        "why), completed, failed or cancelled.")
    step: int = Field(..., description="Last completed step (0 before the first).")
    steps: int = Field(..., description="Steps the spec asks for.")
    created_at: float = Field(..., description="Submission time (Unix seconds).")
    updated_at: float = Field(..., description="Last change (Unix seconds).")
    error: str = Field(..., description="Why the run failed, or why it is paused; empty otherwise.")


class EvalInitialBody(BaseModel):
    accuracy: float = Field(..., description="Greedy accuracy on the task's held-out split before step 1.")
    step: int = Field(..., description="Always 0: the policy before any step.")
    metrics: dict[str, float] = Field(
        default_factory=dict, description="The same evaluation's per-set metrics: 'eval/<set>/avg@<k>' and "
        "'eval/<set>/pass@<k>' for each eval set ('heldout' and eval.sets), plus 'eval_accuracy'.")


class StepMetricsBody(BaseModel):
    step: int = Field(..., description="The step these metrics were recorded for.")
    metrics: dict[str, int | float | list[str]] = Field(
        ..., description="Deterministic metrics of the step (same spec, same values): the trainer's (loss, "
        "iw_mean, ...), trajectory counts, and on eval steps 'eval_accuracy' (greedy held-out accuracy) and, "
        "for each eval set, 'eval/<set>/avg@<k>' (mean reward over k samples per problem) and "
        "'eval/<set>/pass@<k>' (fraction of problems with a correct sample among k). The code task adds "
        "'code_<outcome>' counts and 'code_sample_outcomes', each response's outcome in scoring order "
        "(the only list).")
    timings: dict[str, float] = Field(..., description="Wall time of each phase of the step, in seconds.")


class RunMetricsBody(BaseModel):
    run_id: str = Field(..., description="Run id (12 hex digits).")
    eval_initial: EvalInitialBody | None = Field(..., description="The evaluation before step 1; null until it ran.")
    steps: list[StepMetricsBody] = Field(..., description="Every recorded step, in order.")


NOT_FOUND = {404: {"model": ErrorDetail, "description": "No run has this id (anything not a run id is no run)."}}
INVALID = {422: {"model": InvalidRequestBody, "description": "Invalid request; nothing stored."}}
# Documented, not enforced by FastAPI (that would answer 422): a non-matching id is an unknown run, 404.
RunIdParam = Annotated[str, PathParam(description="A run id as POST /v1/runs returned it.",
                                      json_schema_extra={"pattern": RUN_ID_PATTERN})]


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
    SubmittedRunSpec = confined_run_spec(config.model_roots, config.data_roots, config.scorer_addresses)
    password = redis_password(config)  # read before anything starts: a bad file fails the start
    tracking_targets = TrackingTargets(config.tracking_wandb_mode, config.tracking_mlflow_uri,
                                       config.tracking_tensorboard_dir)

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
        scorers = [RolloutClient(a, config.rpc_timeout_s, token) for a in config.scorer_addresses]
        trainer = TrainerClient(config.trainer_address, config.rpc_timeout_s, token,
                                weights_address=config.trainer_weights_address)

        def make_driver(run_id: str, spec: RunSpec, run_dir: Path) -> RunDriver:
            return RunDriver(run_id, spec, store, rollouts, trainer, exporter, run_dir,
                             config.generate_retries, load_tokenizer,
                             trainer_recovery_timeout_s=config.trainer_recovery_timeout_s,
                             replica_recovery_timeout_s=config.replica_recovery_timeout_s,
                             space_retry=SpaceRetry(config.checkpoint_retry_window_s,
                                                    config.checkpoint_retry_interval_s,
                                                    config.checkpoint_retry_interval_max_s),
                             tracking_targets=tracking_targets, tracking_call_timeout_s=config.tracking_call_timeout_s,
                             scorers=scorers)

        scheduler = RunScheduler(store, make_driver, data_dir, _coordinator_id(data_dir), exporter)
        app.state.store, app.state.exporter, app.state.scheduler = store, exporter, scheduler
        app.state.rollouts, app.state.trainer = rollouts, trainer
        scheduler.start()
        try:
            yield
        finally:
            await scheduler.stop()
            for c in [*rollouts, *scorers, trainer]:
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
        return _refused(validation_fields(exc.errors()))

    def _store(request: Request) -> RunStore:
        return request.app.state.store

    async def _run_or_404(request: Request, run_id: str):
        # One pattern at the edge: `<id>:events` and the like are no run, and never reach a Redis key.
        run = await _store(request).get_run(run_id) if is_run_id(run_id) else None
        if run is None:
            raise HTTPException(status_code=404, detail={"error": "run not found", "run_id": run_id[:64]})
        return run

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(bearer_dependency(token))],
                   responses={401: {"model": ErrorDetail, "description": "Missing or invalid bearer token."}})

    @v1.post("/runs", status_code=201, response_model=RunRecordBody, responses={
        201: {"description": "Stored; the run is pending.",
              "links": {"GetRun": {"operationId": "get_run", "parameters": {"run_id": "$response.body#/id"}},
                        "RunMetrics": {"operationId": "run_metrics", "parameters": {"run_id": "$response.body#/id"}},
                        "CancelRun": {"operationId": "cancel_run", "parameters": {"run_id": "$response.body#/id"}},
                        "ResumeRun": {"operationId": "resume_run", "parameters": {"run_id": "$response.body#/id"}}}},
        413: {"model": InvalidRequestBody, "description": f"Body larger than {MAX_SPEC_BYTES} bytes; nothing stored."},
        **INVALID,
    }, openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/RunSpec"}}}}}, operation_id="submit_run")
    async def submit_run(request: Request) -> dict:
        body = await _read_body(request, MAX_SPEC_BYTES)
        if body is None:
            return _refused([{"field": "(body)", "reason": f"larger than {MAX_SPEC_BYTES} bytes"}], status=413)
        try:
            # start_from names another run's checkpoint: it becomes model_path, checked as any other.
            body = await resolve_start_from(body, _store(request), data_dir)
            # Validation reads datasets and builds the task's splits: a worker thread, not the event loop.
            spec = await asyncio.to_thread(parse_run_spec, body, SubmittedRunSpec)
        except RunSpecError as exc:
            return _refused(exc.fields)
        run = await _store(request).create_run(spec.name, spec.model_dump_json(), spec.steps)
        request.app.state.scheduler.wake()
        return run.to_dict()

    @v1.get("/runs", operation_id="list_runs")
    async def list_runs(request: Request) -> dict:
        return {"runs": [r.to_dict() for r in await _store(request).list_runs()]}

    @v1.get("/runs/{run_id}", responses=NOT_FOUND, operation_id="get_run")
    async def get_run(run_id: RunIdParam, request: Request) -> dict:
        run = await _run_or_404(request, run_id)
        store = _store(request)
        # The spec as stored at submit (already validated); not re-validated here, which would re-read its
        # datasets and could fail later for reasons that are no fault of the request.
        spec = json.loads(await store.get_spec_json(run_id) or "{}")
        latest = (await store.metrics(run_id))[-1:] or [None]
        return {**run.to_dict(), "spec": spec, "eval_initial": await store.get_aux(run_id, "eval_initial"),
                "fingerprint": await store.get_aux(run_id, "fingerprint"),
                "latest": latest[0], "events": await store.events(run_id)}

    @v1.get("/runs/{run_id}/metrics", response_model=RunMetricsBody, responses=NOT_FOUND, operation_id="run_metrics")
    async def run_metrics(run_id: RunIdParam, request: Request) -> dict:
        await _run_or_404(request, run_id)
        store = _store(request)
        return {"run_id": run_id, "eval_initial": await store.get_aux(run_id, "eval_initial"),
                "steps": await store.metrics(run_id)}

    @v1.post("/runs/{run_id}/cancel", response_model=RunRecordBody, responses={
        **NOT_FOUND, 409: {"model": ErrorDetail, "description": "The run already ended."},
    }, operation_id="cancel_run")
    async def cancel_run(run_id: RunIdParam, request: Request) -> dict:
        await _run_or_404(request, run_id)
        if not await _store(request).cancel(run_id):
            run = await _store(request).get_run(run_id)
            raise HTTPException(status_code=409, detail={"error": f"run is already {run.status}", "run_id": run_id})
        return (await _store(request).get_run(run_id)).to_dict()  # type: ignore[union-attr]

    @v1.post("/runs/{run_id}/resume", response_model=RunRecordBody, responses={
        200: {"description": "The paused run is pending again: it is driven on from its last recorded step."},
        **NOT_FOUND, 409: {"model": ErrorDetail, "description": "The run is not paused."},
    }, operation_id="resume_run")
    async def resume_run(run_id: RunIdParam, request: Request) -> dict:
        await _run_or_404(request, run_id)
        if not await _store(request).resume(run_id):
            run = await _store(request).get_run(run_id)
            raise HTTPException(status_code=409, detail={"error": f"run is {run.status}, not paused",
                                                         "run_id": run_id})
        request.app.state.scheduler.wake()
        return (await _store(request).get_run(run_id)).to_dict()  # type: ignore[union-attr]

    v1.include_router(exchange_router(data_dir, NOT_FOUND, INVALID, _refused, _read_body))
    v1.include_router(episodes_router(data_dir, NOT_FOUND[404]["description"], ErrorDetail))
    v1.include_router(samples_router(data_dir, NOT_FOUND[404]["description"], ErrorDetail))
    app.include_router(v1)

    @app.get("/healthz", operation_id="healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.get("/readyz", operation_id="readyz", responses={
        200: {"description": "Redis, the scheduler and every service answer."},
        503: {"description": "Not ready: `checks` says which part does not answer."}})
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

    @app.get("/metrics", operation_id="metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format."}})
    async def metrics(request: Request) -> Response:
        try:
            runs = await _store(request).list_runs()
        except OUTAGE_ERRORS:
            pass  # the services' own metrics still answer during a Redis outage; run counts keep their last values
        else:
            request.app.state.exporter.run_counts({s: sum(r.status == s for r in runs) for s in STATUSES})
        return Response(generate_latest(request.app.state.exporter.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            # The run spec is read from the raw body (bounded, strict, off the event loop), so FastAPI does not
            # see it as a parameter: its schema is added here for the request body to refer to.
            spec_schema = SubmittedRunSpec.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(spec_schema.pop("$defs", {}))
            schemas["RunSpec"] = spec_schema
            schemas["ImportBody"] = ImportBody.model_json_schema(ref_template="#/components/schemas/{model}")
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _refused(fields: list[dict[str, str]], *, status: int = 422) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": "invalid request", "fields": fields})


async def _read_body(request: Request, max_bytes: int) -> bytes | None:
    """The request body, or None as soon as it grows past max_bytes (never buffered beyond that)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            return None
        chunks.append(chunk)
    return b"".join(chunks)

"""REST API (FastAPI). Handlers are thin: validate, call the store, answer.

Every status code a route can answer is declared in its `responses`, so the
OpenAPI document (/openapi.json) is the whole contract; a schemathesis run
over it (tests/coordinator/test_openapi_contract.py) holds it to that.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from services.common.models import load_tokenizer
from services.coordinator.clients import RolloutClient, TrainerClient
from services.coordinator.config import CoordinatorConfig
from services.coordinator.embedded_redis import EmbeddedRedis
from services.coordinator.exporter import CoordinatorExporter
from services.coordinator.run_loop import RunDriver
from services.coordinator.run_spec import MAX_SPEC_BYTES, RunSpec, RunSpecError, parse_run_spec, validation_fields
from services.coordinator.scheduler import RunScheduler
from services.coordinator.store import RUN_ID_PATTERN, STATUSES, RunStore, is_run_id


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
    status: str = Field(..., description="pending, running, completed, failed or cancelled.")
    step: int = Field(..., description="Last completed step (0 before the first).")
    steps: int = Field(..., description="Steps the spec asks for.")
    created_at: float = Field(..., description="Submission time (Unix seconds).")
    updated_at: float = Field(..., description="Last change (Unix seconds).")
    error: str = Field(..., description="Why the run failed; empty otherwise.")


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


def create_app(config: CoordinatorConfig) -> FastAPI:
    data_dir = Path(config.data_dir).resolve()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        data_dir.mkdir(parents=True, exist_ok=True)
        redis = None
        url = config.redis_url
        if not url:
            redis = EmbeddedRedis(data_dir / "redis").start()
            url = redis.url
        store = RunStore(url)
        exporter = CoordinatorExporter()
        rollouts = [RolloutClient(a, config.rpc_timeout_s) for a in config.rollout_addresses]
        trainer = TrainerClient(config.trainer_address, config.rpc_timeout_s)

        def make_driver(run_id: str, spec: RunSpec, run_dir: Path) -> RunDriver:
            return RunDriver(run_id, spec, store, rollouts, trainer, exporter, run_dir,
                             config.generate_retries, load_tokenizer, config.crash_after_train_step,
                             trainer_recovery_timeout_s=config.trainer_recovery_timeout_s)

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
            if redis is not None:
                redis.stop()

    app = FastAPI(title="Lockstep coordinator", version="0.1.0", lifespan=lifespan)

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

    @app.post("/v1/runs", status_code=201, response_model=RunRecordBody, responses={
        201: {"description": "Stored; the run is pending.",
              "links": {"GetRun": {"operationId": "get_run", "parameters": {"run_id": "$response.body#/id"}},
                        "RunMetrics": {"operationId": "run_metrics", "parameters": {"run_id": "$response.body#/id"}},
                        "CancelRun": {"operationId": "cancel_run", "parameters": {"run_id": "$response.body#/id"}}}},
        413: {"model": InvalidRequestBody, "description": f"Body larger than {MAX_SPEC_BYTES} bytes; nothing stored."},
        **INVALID,
    }, openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/RunSpec"}}}}}, operation_id="submit_run")
    async def submit_run(request: Request) -> dict:
        body = await _read_body(request, MAX_SPEC_BYTES)
        if body is None:
            return _refused([{"field": "(body)", "reason": f"larger than {MAX_SPEC_BYTES} bytes"}], status=413)
        try:
            # Validation reads datasets and builds the task's splits: a worker thread, not the event loop.
            spec = await asyncio.to_thread(parse_run_spec, body)
        except RunSpecError as exc:
            return _refused(exc.fields)
        run = await _store(request).create_run(spec.name, spec.model_dump_json(), spec.steps)
        request.app.state.scheduler.wake()
        return run.to_dict()

    @app.get("/v1/runs", operation_id="list_runs")
    async def list_runs(request: Request) -> dict:
        return {"runs": [r.to_dict() for r in await _store(request).list_runs()]}

    @app.get("/v1/runs/{run_id}", responses=NOT_FOUND, operation_id="get_run")
    async def get_run(run_id: RunIdParam, request: Request) -> dict:
        run = await _run_or_404(request, run_id)
        store = _store(request)
        # The spec as stored at submit (already validated); not re-validated here, which would re-read its
        # datasets and could fail later for reasons that are no fault of the request.
        spec = json.loads(await store.get_spec_json(run_id) or "{}")
        latest = (await store.metrics(run_id))[-1:] or [None]
        return {**run.to_dict(), "spec": spec, "eval_initial": await store.get_aux(run_id, "eval_initial"),
                "latest": latest[0], "events": await store.events(run_id)}

    @app.get("/v1/runs/{run_id}/metrics", responses=NOT_FOUND, operation_id="run_metrics")
    async def run_metrics(run_id: RunIdParam, request: Request) -> dict:
        await _run_or_404(request, run_id)
        store = _store(request)
        return {"run_id": run_id, "eval_initial": await store.get_aux(run_id, "eval_initial"),
                "steps": await store.metrics(run_id)}

    @app.post("/v1/runs/{run_id}/cancel", response_model=RunRecordBody, responses={
        **NOT_FOUND, 409: {"model": ErrorDetail, "description": "The run already ended."},
    }, operation_id="cancel_run")
    async def cancel_run(run_id: RunIdParam, request: Request) -> dict:
        await _run_or_404(request, run_id)
        if not await _store(request).set_status(run_id, "cancelled"):
            run = await _store(request).get_run(run_id)
            raise HTTPException(status_code=409, detail={"error": f"run is already {run.status}", "run_id": run_id})
        return (await _store(request).get_run(run_id)).to_dict()  # type: ignore[union-attr]

    @app.get("/healthz", operation_id="healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.get("/readyz", operation_id="readyz", responses={
        200: {"description": "Redis and every service answer."},
        503: {"description": "Not ready: `checks` says which part does not answer."}})
    async def readyz(request: Request) -> JSONResponse:
        checks = {"redis": await _store(request).ping()}
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
        runs = await _store(request).list_runs()
        request.app.state.exporter.run_counts({s: sum(r.status == s for r in runs) for s in STATUSES})
        return Response(generate_latest(request.app.state.exporter.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            # The run spec is read from the raw body (bounded, strict, off the event loop), so FastAPI does not
            # see it as a parameter: its schema is added here for the request body to refer to.
            spec_schema = RunSpec.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(spec_schema.pop("$defs", {}))
            schemas["RunSpec"] = spec_schema
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

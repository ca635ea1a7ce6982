"""REST routes that move runs between deployments and compare them: a run's bundle out, a bundle in,
and the comparison report (services.common.records.run_bundle, services.common.records.run_compare). Thin handlers."""
# No `from __future__ import annotations`: FastAPI resolves the handlers' annotations at runtime.
import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from services.common.records.run_bundle import BundleError, documents_from_upload
from services.common.records.run_compare import RunSeries, compare_runs
from services.coordinator.state.store import RUN_ID_PATTERN, RunStore, is_run_id

MAX_IMPORT_BYTES = 64 * 1024 * 1024
MAX_COMPARED = 8
IMPORTED_FROM = "imported_from"


class ImportBody(BaseModel):
    manifest: dict[str, Any] = Field(..., description="The bundle's manifest.json.")
    files: dict[str, str] = Field(..., description="Each document of the bundle (run.json, spec.json, "
                                  "fingerprint.json, metrics.json, events.json, checkpoint.json) as its file's text.")


RunIdParam = Annotated[str, PathParam(description="A run id as POST /v1/runs returned it.",
                                      json_schema_extra={"pattern": RUN_ID_PATTERN})]


def step_record_path(data_dir: Path, run_id: str, step: int) -> Path:
    """Where the run loop records a step's inputs (debug.record_trajectories)."""
    return data_dir / run_id / "trajectories" / f"step_{step:06d}.pb"


async def run_series(store: RunStore, run_id: str) -> RunSeries:
    run = await store.get_run(run_id)
    assert run is not None
    imported = await store.get_aux(run_id, IMPORTED_FROM)
    # Labelled with the id the run was first given, so a report reads the same on every deployment.
    return RunSeries(label=imported["run_id"] if imported else run_id, name=run.name,
                     steps=await store.metrics(run_id), eval_initial=await store.get_aux(run_id, "eval_initial"),
                     fingerprint=await store.get_aux(run_id, "fingerprint"))


def exchange_router(data_dir: Path, not_found: dict, invalid: dict, refused, read_body) -> APIRouter:
    """`refused(fields, status=...)`: the API's JSON answer for an invalid request; `read_body(request, limit)`
    its bounded body reader."""
    router = APIRouter()

    def _store(request: Request) -> RunStore:
        return request.app.state.store

    async def _run_or_404(request: Request, run_id: str):
        run = await _store(request).get_run(run_id) if is_run_id(run_id) else None
        if run is None:
            raise HTTPException(status_code=404, detail={"error": "run not found", "run_id": run_id[:64]})
        return run

    @router.get("/runs/{run_id}/bundle", responses=not_found, operation_id="run_bundle")
    async def run_bundle(run_id: RunIdParam, request: Request) -> dict:
        """Every document of the run's portable bundle, and the steps whose recorded inputs can be fetched."""
        run = await _run_or_404(request, run_id)
        store = _store(request)
        records = sorted(int(p.stem.removeprefix("step_")) for p in (data_dir / run_id / "trajectories").glob(
            "step_[0-9][0-9][0-9][0-9][0-9][0-9].pb"))
        return {
            "run": run.to_dict(),
            "spec": json.loads(await store.get_spec_json(run_id) or "{}"),
            "fingerprint": await store.get_aux(run_id, "fingerprint"),
            "metrics": {"eval_initial": await store.get_aux(run_id, "eval_initial"),
                        "steps": await store.metrics(run_id)},
            "events": await store.events(run_id),
            "checkpoint": (await store.get_aux(run_id, "last_checkpoint")
                           or await store.get_aux(run_id, "checkpoint_reference")),
            "step_records": records,
        }

    @router.get("/runs/{run_id}/step_records/{step}", response_class=Response, responses={
        200: {"content": {"application/octet-stream": {}}, "description": "The recorded step (step_record format)."},
        **not_found, **invalid}, operation_id="run_step_record")
    async def run_step_record(run_id: RunIdParam, step: Annotated[int, PathParam(ge=1, le=10**6)],
                              request: Request) -> Response:
        await _run_or_404(request, run_id)
        path = step_record_path(data_dir, run_id, step)
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise HTTPException(status_code=404, detail={"error": f"step {step} of the run was not recorded",
                                                         "run_id": run_id}) from None
        return Response(data, media_type="application/octet-stream")

    @router.post("/runs/import", status_code=201, responses={
        201: {"description": "Stored under a new id, with the status it ended with; it is never driven."},
        413: {"description": f"Body larger than {MAX_IMPORT_BYTES} bytes; nothing stored."}, **invalid,
    }, openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/ImportBody"}}}}}, operation_id="import_run")
    async def import_run(request: Request) -> Any:
        body = await read_body(request, MAX_IMPORT_BYTES)
        if body is None:
            return refused([{"field": "(body)", "reason": f"larger than {MAX_IMPORT_BYTES} bytes"}], status=413)
        try:
            upload = ImportBody.model_validate_json(body)
        except ValueError as exc:
            errors = getattr(exc, "errors", lambda: [])()
            return refused([{"field": ".".join(str(p) for p in e.get("loc", ())) or "(body)", "reason": e.get("msg", "")}
                            for e in errors] or [{"field": "(body)", "reason": str(exc)[:200]}])
        try:
            docs = await asyncio.to_thread(documents_from_upload, upload.manifest, upload.files)
        except BundleError as exc:
            return refused([{"field": f"files.{exc.field}" if exc.field != "manifest.json" else "manifest",
                             "reason": exc.reason}])
        run = docs["run.json"]
        aux = {IMPORTED_FROM: {"run_id": run["id"]}}
        if docs["metrics.json"].get("eval_initial") is not None:
            aux["eval_initial"] = docs["metrics.json"]["eval_initial"]
        if docs["fingerprint.json"] is not None:
            aux["fingerprint"] = docs["fingerprint.json"]
        if docs["checkpoint.json"] is not None:
            aux["checkpoint_reference"] = docs["checkpoint.json"]
        record = await _store(request).import_run(run, json.dumps(docs["spec.json"]), docs["metrics.json"]["steps"],
                                                  docs["events.json"], aux)
        return JSONResponse(status_code=201, content=record.to_dict())

    @router.get("/compare", responses={**not_found, **invalid}, operation_id="compare_runs")
    async def compare(request: Request,
                      runs: Annotated[str, Query(max_length=MAX_COMPARED * 13,
                                                 description="Run ids, comma separated; the first is the reference.")],
                      window: Annotated[int | None, Query(ge=1, le=10**6, description="Steps per window.")] = None) -> Any:
        ids = [r.strip() for r in runs.split(",") if r.strip()]
        if not 2 <= len(ids) <= MAX_COMPARED:
            return refused([{"field": "runs", "reason": f"2 to {MAX_COMPARED} run ids, got {len(ids)}"}])
        for run_id in ids:
            await _run_or_404(request, run_id)
        series = [await run_series(_store(request), run_id) for run_id in ids]
        return compare_runs(series, window=window)

    return router


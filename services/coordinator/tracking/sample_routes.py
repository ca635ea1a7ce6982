"""GET /v1/runs/{run_id}/steps/{step}/samples: the samples a step trained on, paged (step_samples.py)."""
# No `from __future__ import annotations`: FastAPI resolves the handlers' annotations at runtime.
import asyncio
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi import Path as PathParam
from pydantic import BaseModel, Field

from services.coordinator.state.store import RUN_ID_PATTERN, RunStore, is_run_id
from services.coordinator.tracking.step_samples import page, read_samples

MAX_PAGE = 1000
RunIdParam = Annotated[str, PathParam(description="A run id as POST /v1/runs returned it.",
                                      json_schema_extra={"pattern": RUN_ID_PATTERN})]
StepParam = Annotated[int, PathParam(ge=1, le=1_000_000, description="A step of the run (1-based).")]


class SampleBody(BaseModel):
    index: int = Field(..., description="Position in the step's trainer input (record order).")
    sample_id: str = Field(..., description="<group id>/<index in the group>.")
    group_id: str = Field(..., description="The GRPO group (one prompt) the sample belongs to.")
    prompt: str = Field(..., description="The prompt tokens, decoded by the run's tokenizer.")
    response: str = Field(..., description="The response tokens, decoded (special tokens kept).")
    prompt_token_ids: list[int] = Field(..., description="Prompt token ids as trained.")
    response_token_ids: list[int] = Field(..., description="Response token ids as trained.")
    reward: float = Field(..., description="The task's reward (float32, widened exactly).")
    advantage: float = Field(..., description="The GRPO advantage the trainer used (float32, widened exactly).")
    length: int = Field(..., description="Response tokens.")
    finish_reason: str = Field(..., description="Why generation stopped (stop, length, ...).")
    policy_version: int = Field(..., description="Policy version that sampled the first token.")
    policy_version_last: int = Field(..., description="Policy version that sampled the last token (differs "
                                     "only when async.mode streaming continued it under newer weights).")
    iw_min: float | None = Field(..., description="Smallest importance weight exp(logp - rollout_logp) over its "
                                 "response tokens, as the trainer measured it before the update; null when not "
                                 "reported (a step replayed after a coordinator restart).")
    iw_max: float | None = Field(..., description="Largest importance weight over its response tokens.")


class StepSamplesBody(BaseModel):
    run_id: str
    step: int
    total: int = Field(..., description="Samples matching the filter (the step's all, without `group`).")
    offset: int
    limit: int
    order: str
    iw: dict[str, float] = Field(..., description="The step's importance-weight range over every response token "
                                 "(iw_min, iw_mean, iw_max, as in its metrics); empty while the step is not "
                                 "recorded.")
    samples: list[SampleBody]


def samples_router(data_dir: Path, not_found_description: str, error_model: type[BaseModel]) -> APIRouter:
    router = APIRouter()

    @router.get("/runs/{run_id}/steps/{step}/samples", response_model=StepSamplesBody, responses={
        404: {"model": error_model, "description": not_found_description + " Or the step's samples are not "
              "kept (not reached yet, or older than the run's samples.keep_steps)."},
    }, operation_id="step_samples")
    async def step_samples(
        run_id: RunIdParam, step: StepParam, request: Request,
        order: Annotated[Literal["record", "worst", "best"], Query(
            description="record: as trained; worst: lowest reward first; best: highest first (ties in record "
            "order).")] = "record",
        group: Annotated[str | None, Query(max_length=256, description="Only this group's samples.")] = None,
        offset: Annotated[int, Query(ge=0, le=100_000_000, description="Samples to skip.")] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="Samples in the page.")] = 100,
    ) -> dict:
        store: RunStore = request.app.state.store
        if not is_run_id(run_id) or await store.get_run(run_id) is None:
            raise HTTPException(status_code=404, detail={"error": "run not found", "run_id": run_id[:64]})
        samples = await asyncio.to_thread(read_samples, data_dir / run_id, step)
        if samples is None:
            raise HTTPException(status_code=404, detail={"error": "no samples kept for this step", "run_id": run_id,
                                                         "step": step})
        total, chosen = page(samples, order=order, group=group, offset=offset, limit=limit)
        metrics = await store.step_metrics(run_id, step) or {}
        iw = {k: float(metrics[k]) for k in ("iw_min", "iw_mean", "iw_max") if k in metrics}
        return {"run_id": run_id, "step": step, "total": total, "offset": offset, "limit": limit, "order": order,
                "iw": iw, "samples": chosen}

    return router

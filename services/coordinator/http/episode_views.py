"""GET /v1/runs/{run_id}/steps/{step}/episodes: a recorded step's episodes, one summary each.

A step's episodes are read back from its trajectory record (written when the run sets
debug.record_trajectories): each trajectory of an episodic task carries its episode record (turns,
per-turn rewards, tool calls, end reason) beside its response mask.
"""
# No `from __future__ import annotations`: FastAPI resolves the handlers' annotations at runtime.
import asyncio
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

import numpy as np
from fastapi import APIRouter, HTTPException, Request
from fastapi import Path as PathParam
from pydantic import BaseModel, Field

from proto import lockstep_pb2 as pb
from services.common.records.step_record import read_step_record
from services.coordinator.state.store import RUN_ID_PATTERN, RunStore, is_run_id

RunIdParam = Annotated[str, PathParam(description="A run id as POST /v1/runs returned it.",
                                      json_schema_extra={"pattern": RUN_ID_PATTERN})]
StepParam = Annotated[int, PathParam(ge=1, le=1_000_000, description="A step of the run (1-based).")]


class EpisodeBody(BaseModel):
    sample_id: str = Field(..., description="The trajectory's sample id (<group id>/<index>).")
    reward: float = Field(..., description="The environment's reward: the sum of turn_rewards.")
    advantage: float = Field(..., description="The GRPO advantage the trainer used.")
    turns: int = Field(..., description="Model turns taken.")
    turn_rewards: list[float] = Field(..., description="The environment's reward after each turn.")
    tool_calls: int = Field(..., description="Turns the environment counted as a tool call.")
    tool_errors: int = Field(..., description="Tool calls that failed.")
    end_reason: str = Field(..., description="Why the episode ended (docs/multi-turn.md).")
    prompt_tokens: int = Field(..., description="Tokens of the first observation.")
    model_tokens: int = Field(..., description="Response tokens the model sampled (in the loss).")
    environment_tokens: int = Field(..., description="Response tokens of observations (context only).")


class StepEpisodesBody(BaseModel):
    run_id: str
    step: int
    episodes: list[EpisodeBody] = Field(..., description="Every trained episode of the step, in record order.")


def episode_views(trajectories: Iterable[pb.Trajectory]) -> list[dict]:
    """A summary of each trajectory that is an episode (has an episode record), in order."""
    out = []
    for t in trajectories:
        if not t.HasField("episode"):
            continue
        mask = np.frombuffer(t.response_mask.data, dtype=np.bool_)
        model = int(mask.sum())
        out.append({"sample_id": t.sample_id, "reward": float(t.reward), "advantage": float(t.advantage),
                    "turns": t.episode.turns, "turn_rewards": list(t.episode.turn_rewards),
                    "tool_calls": t.episode.tool_calls, "tool_errors": t.episode.tool_errors,
                    "end_reason": t.episode.end_reason,
                    "prompt_tokens": int(t.prompt_token_ids.shape[0]) if t.prompt_token_ids.shape else 0,
                    "model_tokens": model, "environment_tokens": int(mask.size) - model})
    return out


def episodes_router(data_dir: Path, not_found_description: str, error_model: type[BaseModel]) -> APIRouter:
    router = APIRouter()

    @router.get("/runs/{run_id}/steps/{step}/episodes", response_model=StepEpisodesBody, responses={
        404: {"model": error_model, "description": not_found_description + " Or the step has no trajectory "
              "record (the run did not set debug.record_trajectories, or has not reached the step)."},
    }, operation_id="step_episodes")
    async def step_episodes(run_id: RunIdParam, step: StepParam, request: Request) -> dict:
        store: RunStore = request.app.state.store
        if not is_run_id(run_id) or await store.get_run(run_id) is None:
            raise HTTPException(status_code=404, detail={"error": "run not found", "run_id": run_id[:64]})
        path = data_dir / run_id / "trajectories" / f"step_{step:06d}.pb"
        if not path.is_file():
            raise HTTPException(status_code=404, detail={"error": "no trajectory record", "run_id": run_id,
                                                         "step": step})
        try:
            _, chunks = await asyncio.to_thread(read_step_record, path)
        except ValueError as exc:  # a record this coordinator cannot read: nothing to show, said so
            raise HTTPException(status_code=404, detail={"error": f"unreadable trajectory record: {exc}",
                                                         "run_id": run_id, "step": step}) from None
        trajectories = [c.trajectory for c in chunks if c.WhichOneof("item") == "trajectory"]
        return {"run_id": run_id, "step": step, "episodes": episode_views(trajectories)}

    return router

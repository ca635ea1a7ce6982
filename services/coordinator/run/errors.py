"""How a run ends other than by completing: shared by the run loop and its collaborators."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class RunCancelled(Exception):
    """The run was cancelled (or ended) while the driver ran it."""


class RunFailed(Exception):
    """The run cannot go on; the message says which step and why."""


class RunPaused(Exception):
    """The run cannot go on until an operator acts (a full checkpoint disk freed): it is held as `paused`
    with this message, and POST /v1/runs/{id}/resume drives it on from its cursor."""


class RunRecords(Protocol):
    async def get_run(self, run_id: str) -> Any | None: ...


@dataclass(frozen=True)
class CancelCheck:
    """Raises RunCancelled once the run is cancelled or gone from the store. The loop, the fleet and the
    trainer session call it between pieces of work; it reads the store, so it holds no state of the loop."""

    store: RunRecords
    run_id: str

    async def __call__(self) -> None:
        run = await self.store.get_run(self.run_id)
        if run is None or run.status == "cancelled":
            raise RunCancelled(self.run_id)

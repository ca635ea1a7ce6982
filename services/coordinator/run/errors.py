"""How a run ends other than by completing: shared by the run loop and its collaborators."""
from __future__ import annotations


class RunCancelled(Exception):
    """The run was cancelled (or ended) while the driver ran it."""


class RunFailed(Exception):
    """The run cannot go on; the message says which step and why."""


class RunPaused(Exception):
    """The run cannot go on until an operator acts (a full checkpoint disk freed): it is held as `paused`
    with this message, and POST /v1/runs/{id}/resume drives it on from its cursor."""

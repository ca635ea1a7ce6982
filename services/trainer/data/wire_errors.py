"""The two ways a TrainStep (or any trainer RPC) is refused; the server maps them to gRPC status codes."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """The request itself is malformed; maps to INVALID_ARGUMENT."""


class FailedPrecondition(RuntimeError):
    """The request is well-formed but the trainer's state does not allow it; maps to FAILED_PRECONDITION."""

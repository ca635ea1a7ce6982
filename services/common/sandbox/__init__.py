"""Running untrusted Python (model-written code) against tests in a bubblewrap sandbox; docs/sandbox.md."""
from services.common.sandbox.bwrap import SandboxUnavailable
from services.common.sandbox.executor import Execution, ExecutionResult, Outcome
from services.common.sandbox.pool import SandboxPool
from services.common.sandbox.settings import SandboxLimits, SandboxSettings

__all__ = ["Execution", "ExecutionResult", "Outcome", "SandboxLimits", "SandboxPool", "SandboxSettings",
           "SandboxUnavailable"]

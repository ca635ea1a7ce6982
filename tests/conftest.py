"""Shared test policy.

Tests that need an external binary or optional package call `require(...)`:
on a user's machine a missing part skips with the stated reason; in CI
(`LOCKSTEP_REQUIRE_ALL=1`) the same absence fails the test, so nothing CI is
meant to exercise can quietly turn into a skip.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Without a GPU the Triton kernels run in Triton's interpreter, which Triton decides when it is first
# imported (its own library functions are decorated then). Modules the tests import may import Triton
# early (torch._dynamo does, and kernels.attention.hf imports that), so it is decided here, first.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def require_all() -> bool:
    return os.environ.get("LOCKSTEP_REQUIRE_ALL", "") == "1"


def require(available: bool, reason: str) -> None:
    """Skip (user machine) or fail (CI) when `available` is false."""
    if available:
        return
    if require_all():
        pytest.fail(f"LOCKSTEP_REQUIRE_ALL=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under LOCKSTEP_REQUIRE_ALL=1 no test may skip, whatever skipped it (importorskip included)."""
    outcome = yield
    report = outcome.get_result()
    if require_all() and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"LOCKSTEP_REQUIRE_ALL=1 forbids skips: {report.longrepr}"

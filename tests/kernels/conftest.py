"""Kernel tests: Triton's interpreter evaluates tl.dot in one fixed order (interpreted_dot.py says why)."""
from __future__ import annotations

import importlib.util
import os

import pytest

from tests.conftest import REPO_ROOT
from tests.kernels.target_compile import STARTED, TEST_FILE, CheckTargetsProcess, can_start


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the AOT compile check now when it is among the tests to run, leaving one core to the suite:
    it overlaps the rest of the suite on what the suite leaves idle (target_compile.py)."""
    if session.config.option.collectonly or not can_start():
        return
    if any(item.nodeid.startswith(TEST_FILE) for item in session.items):
        session.stash[STARTED] = CheckTargetsProcess.start(REPO_ROOT, jobs=max(1, (os.cpu_count() or 2) - 1))


def pytest_sessionfinish(session: pytest.Session) -> None:
    started = session.stash.get(STARTED, None)
    if started is not None:
        started.stop()


@pytest.fixture(autouse=True, scope="session")
def fixed_order_interpreted_dot():
    """Interpreted kernels reduce every tl.dot output the same way, whatever BLAS numpy has.

    Installed on every host: it changes nothing where kernels are compiled, and the tests of the
    dot itself run everywhere. Without Triton there is nothing to install (those tests `require` it).
    """
    if importlib.util.find_spec("triton") is None:
        yield
        return
    from tests.kernels.interpreted_dot import install_fixed_order_dot

    undo = install_fixed_order_dot()
    yield
    undo()

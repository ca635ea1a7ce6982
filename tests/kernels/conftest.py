"""Kernel tests: Triton's interpreter evaluates tl.dot in one fixed order (interpreted_dot.py says why)."""
from __future__ import annotations

import importlib.util

import pytest


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

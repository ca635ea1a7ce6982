"""KernelLauncher's decisions (triton_launch.py), with a stand-in for the JIT function and the driver.

What a compiled launch computes is checked on a GPU (test_logprob_gpu.py compares it bitwise with
the JIT path); here: when the cache is read or filled, and when every call must take the JIT path.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is a dependency of the log-prob kernels")

from triton import knobs  # noqa: E402

from kernels.logprob.triton_launch import KernelLauncher, compiled_launch_supported  # noqa: E402


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.runs = []

    def run(self, *a):
        self.runs.append(a)


class _Jit:
    def __init__(self):
        self.calls, self.compiled = [], []

    def __getitem__(self, grid):
        def launch(*args, num_warps):
            self.calls.append((grid, args, num_warps))
            self.compiled.append(_Compiled())
            return self.compiled[-1]
        return launch


class _Driver:
    class active:
        device = 0

        @classmethod
        def get_current_device(cls):
            return cls.device

        @staticmethod
        def get_current_stream(device):
            return f"stream{device}"


def _launcher(reuse=True):
    jit = _Jit()
    launcher = KernelLauncher(jit, reuse_compiled=reuse)
    if reuse:
        launcher._driver = _Driver
    return jit, launcher


def test_first_call_compiles_through_the_jit_then_the_compiled_kernel_is_reused():
    jit, launcher = _launcher()
    launcher.launch(("bf16", True), (4, 2, 1), ("x", 7, 1.5, True), 1)
    launcher.launch(("bf16", True), (9, 2, 1), ("y", 8, 0.5, True), 1)
    assert len(jit.calls) == 1
    (ck,) = jit.compiled
    assert ck.runs == [(9, 2, 1, "stream0", "fn", "meta", None, None, None, "y", 8, 0.5, True)]
    launcher.launch(("bf16", False), (1, 1, 1), ("z", 8, 0.5, True), 1)  # another key compiles again
    assert len(jit.calls) == 2 and sorted(k[1] for k in launcher.cached_keys()) == [("bf16", False), ("bf16", True)]


def test_compiled_kernels_are_kept_per_device():
    jit, launcher = _launcher()
    launcher.launch(("k",), (1, 1, 1), (1,), 1)
    _Driver.active.device = 1
    try:
        launcher.launch(("k",), (1, 1, 1), (1,), 1)
    finally:
        _Driver.active.device = 0
    assert len(jit.calls) == 2 and not jit.compiled[0].runs


def test_integers_past_int32_never_touch_the_cache():
    jit, launcher = _launcher()
    launcher.launch(("k",), (1, 1, 1), (2**31,), 1)
    launcher.launch(("k",), (1, 1, 1), (2**31,), 1)
    assert len(jit.calls) == 2 and launcher.cached_keys() == []


def test_installed_launch_hooks_see_every_launch_through_the_jit():
    jit, launcher = _launcher()
    launcher.launch(("k",), (1, 1, 1), (1,), 1)

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launcher.launch(("k",), (1, 1, 1), (1,), 1)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(jit.calls) == 2 and not jit.compiled[0].runs
    launcher.launch(("k",), (1, 1, 1), (1,), 1)
    assert len(jit.compiled[0].runs) == 1


def test_without_reuse_every_call_binds_through_the_jit():
    jit, launcher = _launcher(reuse=False)
    for _ in range(3):
        launcher.launch(("k",), (1, 1, 1), (1,), 1)
    assert len(jit.calls) == 3 and launcher.cached_keys() == []


def test_reuse_only_on_nvidia_outside_the_interpreter():
    assert not compiled_launch_supported(is_cuda=False, interpreted=False)  # ROCm: pointers specialize on size
    assert not compiled_launch_supported(is_cuda=True, interpreted=True)

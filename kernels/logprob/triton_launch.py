"""Launch a compiled Triton kernel again without the JIT re-binding every argument.

`kernel[grid](*args)` specializes each argument (alignment of every pointer,
divisibility of every integer) and hashes the result on every call: on the
H200 host that is ~25 us of a ~37 us launch, three times per forward+backward,
as long as the kernels themselves at T=2048. The log-prob kernels are declared
so that what the JIT specializes on changes only with what the caller can name
cheaply (triton_kernels.py: the per-call integers are `do_not_specialize`, the
scratch and user pointers `do_not_specialize_on_alignment`); the rest -- the
constexprs, the dtypes, the shard layout that fixes every size, the logits row
stride and the logits/gradient pointers' alignment -- is the `key` the backend
passes. The first call for a key goes through the JIT (compiling if needed)
and keeps the compiled kernel; later calls hand the arguments straight to it.

Only where that holds: on NVIDIA (Triton's AMD backend also specializes every
pointer on its tensor fitting in 2 GB, which the key does not capture), with the
Triton version whose launcher calling convention this was checked against, with
no launch hooks installed (profilers), and never in the interpreter. Anywhere
else every call takes the JIT path: same kernels, same bits, more host time.
"""
from __future__ import annotations

from typing import Any

CHECKED_TRITON = ("3.6.",)
_I32 = (-(2**31), 2**31 - 1)


def compiled_launch_supported(is_cuda: bool, interpreted: bool) -> bool:
    if interpreted or not is_cuda:
        return False
    import triton

    return triton.__version__.startswith(CHECKED_TRITON)


class KernelLauncher:
    """One @triton.jit kernel; `launch(key, grid, args, num_warps)` with every parameter in signature order."""

    def __init__(self, jit_fn: Any, reuse_compiled: bool) -> None:
        self._fn = jit_fn
        self._reuse = reuse_compiled
        self._compiled: dict[tuple, Any] = {}
        if reuse_compiled:
            from triton import knobs
            from triton.runtime import driver

            self._knobs, self._driver = knobs, driver

    def launch(self, key: tuple, grid: tuple[int, int, int], args: tuple, num_warps: int) -> None:
        # An integer past int32 would compile as i64, and a profiler's launch hooks must see every
        # launch: both take the JIT path, without reading or filling the cache.
        if self._reuse and not self._hooks_installed() and _ints_fit_i32(args):
            device = self._driver.active.get_current_device()  # compiled kernels are per device, as in the JIT
            ck = self._compiled.get((device, key))
            if ck is not None:
                stream = self._driver.active.get_current_stream(device)
                ck.run(grid[0], grid[1], grid[2], stream, ck.function, ck.packed_metadata, None, None, None, *args)
                return
            compiled = self._fn[grid](*args, num_warps=num_warps)
            if compiled is not None:
                self._compiled[(device, key)] = compiled
            return
        self._fn[grid](*args, num_warps=num_warps)

    def _hooks_installed(self) -> bool:
        # Triton 3.6 keeps launch hooks in a HookChain (empty: none installed); older ones used None.
        hook = self._knobs.runtime.launch_enter_hook
        return hook is not None and bool(getattr(hook, "calls", True))

    def cached_keys(self) -> list[tuple]:
        return list(self._compiled)


def _ints_fit_i32(args: tuple) -> bool:
    lo, hi = _I32
    for a in args:
        if a.__class__ is int and not lo <= a <= hi:
            return False
    return True

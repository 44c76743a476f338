"""Launches through cached compiled kernels instead of `JITFunction.run` on every call.

`kernel[grid](...)` runs Triton's JIT dispatch each time: it binds and
specialises every argument, builds the cache key and looks it up (about 8 us
of Python per launch). The `CompiledKernel` it returns launches directly
through its launcher in well under a microsecond. `CachedKernel` keeps that
`CompiledKernel` per (device, variant) and calls it the way `JITFunction.run`
does (Triton 3.6 to 3.9: `run(grid x, y, z, stream, function, packed
metadata, launch metadata, enter hook, exit hook, *every argument)`).

The variant is what a launcher knows changes the kernel's specialisation: the
dtypes of caller tensors and the constexpr flags. Everything else the kernels
could specialise on is fixed by construction: sizes, strides and counts are
`do_not_specialize`, caller tensors are `do_not_specialize_on_alignment`, and
every other pointer is a workspace piece or layout table at a fixed 16-byte
alignment (or at a fixed offset from one). A miss (first launch, a new
variant, a new device) and a launch with no stream (the Triton interpreter,
which has no `CompiledKernel`) go through `kernel[grid](...)` as before, so
correctness never depends on the cache. Launch hooks (profilers) see cached
launches as the JIT's: the same launch metadata and hooks are passed.
`tests/kernels/test_launch_budget_sm90.py` checks that every cached launch
runs the very kernel the JIT would pick.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from triton import knobs

# Launches that went through the JIT (`kernel[grid]`) and through a cached kernel, by kernel
# name: what the call-budget tests read.
launch_counts: dict[str, list[int]] = {}


class LaunchTarget(NamedTuple):
    """Where a launch goes: the current device's index and the raw handle of its current stream
    (None: launch through the JIT, as under the interpreter)."""

    device: int
    stream: int | None


class CachedKernel:
    """A `@triton.jit` kernel whose compiled variants are launched directly once known."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.name = kernel.fn.__name__
        self._compiled: dict[tuple[int, Hashable], Any] = {}
        # Constexpr parameters trail every kernel of the planner; the launcher takes their values
        # after the others, in parameter order.
        # (The interpreter's kernels have no params: they never launch cached.)
        params = getattr(kernel, "params", ())
        self._constexpr_names = [param.name for param in params if param.is_constexpr]
        self._counts = launch_counts.setdefault(self.name, [0, 0])

    def launch(
        self,
        grid: Sequence[int],
        variant: Hashable,
        stream: int | None,
        device: int,
        args: Sequence[Any],
        constexprs: dict[str, Any],
        num_warps: int,
    ) -> None:
        """`kernel[grid](*args, **constexprs, num_warps=...)` on `device`'s `stream`.

        `stream` is the raw CUDA stream handle of the current stream of `device`
        (the device current in the calling thread), or None to launch through the
        JIT. Falls back to the JIT on a miss, then keeps what it compiled.
        """
        compiled = None if stream is None else self._compiled.get((device, variant))
        if compiled is None:
            self._counts[0] += 1
            kernel = self.kernel[tuple(grid)](*args, **constexprs, num_warps=num_warps)
            if stream is not None and hasattr(kernel, "packed_metadata"):
                self._compiled[(device, variant)] = kernel
            return
        self._counts[1] += 1
        x, y, z = (*grid, 1, 1)[:3]
        every_arg = (*args, *[constexprs[name] for name in self._constexpr_names])
        compiled.run(
            x,
            y,
            z,
            stream,
            compiled.function,
            compiled.packed_metadata,
            compiled.launch_metadata(grid, stream, *every_arg),  # None without launch hooks
            knobs.runtime.launch_enter_hook,
            knobs.runtime.launch_exit_hook,
            *every_arg,
        )

    def compiled(self, device: int, variant: Hashable) -> Any:
        """The cached `CompiledKernel` of `variant` on `device`, or None (for tests)."""
        return self._compiled.get((device, variant))


_cached: dict[Any, CachedKernel] = {}
_cached_lock = threading.Lock()


def cached_kernel(kernel: Any) -> CachedKernel:
    """The process's `CachedKernel` of `kernel` (made at its first launch)."""
    cached = _cached.get(kernel)
    if cached is None:
        with _cached_lock:
            cached = _cached.setdefault(kernel, CachedKernel(kernel))
    return cached


def launch(
    kernel: Any,
    grid: Sequence[int],
    variant: Hashable,
    target: LaunchTarget | None,
    args: Sequence[Any],
    constexprs: dict[str, Any],
    num_warps: int,
) -> None:
    """Launch `kernel` on the current device and stream: cached when `target` has a stream.

    `variant` must name every dtype and flag the launch's specialisation
    depends on (the module docstring says why nothing else can vary).
    """
    device, stream = (0, None) if target is None else target
    cached_kernel(kernel).launch(grid, variant, stream, device, args, constexprs, num_warps)

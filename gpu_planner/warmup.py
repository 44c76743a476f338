"""Compile every kernel variant the planner can launch, before any request needs one.

A Triton kernel compiles the first time it meets a new specialisation. The
kernels never specialise on sizes, counts or strides (`do_not_specialize`,
int64 scalars) nor on the alignment of caller tensors, so what remains is
finite: the page dtypes (int32/int64 of each page list) and the constexpr
flags (a device space or not, host slots or not). `warmup` launches each of
them once on tiny inputs through the real launchers, so it compiles exactly
what requests launch, into Triton's per-device cache.

The head-slice gather and scatter (`kernels/slice_copy.py`) also take
constexprs from the copy's geometry: the page size, the copy unit and the
tile. A server's KV geometry fixes the finite set its copies can take
(`SliceCopies`), and `warm_up_slice_copies` compiles that set once it is
known (the sglang plugin: when sglang builds its KV manager).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.cuda_streams import on_torch_device, side_stream
from gpu_planner.layout import BufferLayout

PAGE_DTYPES = (torch.int32, torch.int64)


def warmup(torch_device: torch.device | str | int | None = None) -> int:
    """Compile every kernel variant the planner needs on `torch_device`, off the request path.

    Args:
        torch_device: a CUDA device (default: the current one). On a CPU
            device this compiles the CPU backend's loops instead.

    Returns:
        The number of kernel launches made (each compiles at most once per
        process; Triton's disk cache makes later processes fast).

    Example:
        >>> gp.warmup(torch.device("cuda", torch.cuda.current_device()))  # doctest: +SKIP
    """
    if torch_device is None:
        torch_device = torch.device("cuda", torch.cuda.current_device())
    torch_device = torch.device(torch_device)
    if torch_device.type == "cpu":
        from gpu_planner import cpu_backend

        cpu_backend.compile_kernels()
        return 0
    if torch_device.index is None:
        torch_device = torch.device("cuda", torch.cuda.current_device())
    with on_torch_device(torch_device):
        side_stream(torch_device)
        return warm_up_kernels(torch_device)


def warm_up_kernels(torch_device: torch.device) -> int:
    """Launch every kernel variant once on `torch_device` (current stream); return the count.

    Runs the launchers themselves on two-page inputs, so every variant is the
    one a request would launch, and on CUDA keeps each compiled kernel for the
    cached launches (`kernels/launcher.py`): a request then never goes through
    the JIT. The Triton interpreter (a CPU device) runs the same launches and
    compiles nothing.
    """
    from gpu_planner.kernels.expand_descriptors import launch_expand_descriptors
    from gpu_planner.kernels.launcher import LaunchTarget
    from gpu_planner.kernels.page_indices import launch_page_indices
    from gpu_planner.runs import launch_runs

    target = None
    if torch_device.type == "cuda":
        runtime = cuda_runtime()
        index = runtime.device_context(torch_device).index
        target = LaunchTarget(index, runtime.launch_stream(index))

    def pages(dtype: torch.dtype) -> torch.Tensor:
        return torch.arange(2, dtype=dtype, device=torch_device)

    launches = 0
    for device_dtype in PAGE_DTYPES:
        for host_dtype in (None, *PAGE_DTYPES):
            host_slots = None if host_dtype is None else pages(host_dtype)
            launch_page_indices(host_slots, pages(device_dtype), 0, 2, 1, target)
            launches += 1
    layouts = {
        False: BufferLayout([0], [0], [1]),
        True: BufferLayout([0, 0], [0, 0], [1, 1], dst_is_device=[False, True]),
    }
    for has_device, layout in layouts.items():
        tables = layout.tables(torch_device)
        device_dtypes = PAGE_DTYPES if has_device else (None,)
        for src_dtype, dst_dtype, device_dtype in itertools.product(
            PAGE_DTYPES, PAGE_DTYPES, device_dtypes
        ):
            page_lists = {"src_pages": pages(src_dtype), "dst_pages": pages(dst_dtype)}
            if device_dtype is not None:
                page_lists["dst_device_pages"] = pages(device_dtype)
            runs = launch_runs(page_lists, 1, num_buffers=layout.num_buffers, target=target)
            # Two pages make at most two runs per space: an upper bound sizes the output.
            run_counts = [2] * runs.num_spaces
            launch_expand_descriptors(
                tables, layout.num_host_buffers, layout.num_device_buffers, runs, run_counts, target
            )
            launches += 4
    return launches


_ALIGNMENT = 16  # bytes: the widest copy unit, and the pointer alignment Triton specialises on


@dataclass(frozen=True)
class SliceCopies:
    """The head-slice copies one path of a server makes, as what fixes their kernel variants.

    Each copy moves a chunk of some of the entries: its widest slice is one of
    `slice_lens`, and its copy unit is the gcd of 16, its entries' addresses
    and lengths (a multiple of `unit`, their gcd over every entry, and a
    divisor of its widest slice) and the staging address, which is 16-byte
    aligned plus a multiple of `staging_step`.
    """

    scatter: bool  # False: the gather (`gpu_planner.head_gather`)
    page_size: int
    slice_lens: tuple[int, ...]  # bytes, per entry
    unit: int  # gcd(16, every entry's addresses and lengths): 1, 2, 4, 8 or 16
    staging_step: int = _ALIGNMENT
    page_dtypes: tuple[torch.dtype, ...] = PAGE_DTYPES

    def shapes(self) -> set[tuple[int, int, bool]]:
        """(widest slice, copy unit, staging 16-byte aligned) of every copy the path can make."""
        step = math.gcd(_ALIGNMENT, self.staging_step)
        shapes = set()
        for widest in set(self.slice_lens) - {0}:  # a slice of no bytes launches nothing
            ceiling = math.gcd(_ALIGNMENT, widest)
            units = [2**power for power in range(5) if 2**power % self.unit == 0]
            for chunk_unit in (unit for unit in units if ceiling % unit == 0):
                for residue in range(0, _ALIGNMENT, step):
                    unit = math.gcd(chunk_unit, residue or _ALIGNMENT)
                    shapes.add((widest, unit, residue == 0))
        return shapes


def warm_up_slice_copies(torch_device: torch.device, copies: Iterable[SliceCopies]) -> int:
    """Compile every gather and scatter variant `copies` can launch on `torch_device`; return
    the launches made.

    Each variant is launched once through the real launcher, on the
    current stream, copying one page within a scratch allocation: the
    launcher derives its constexprs from the entries as a request's copy
    does, so the variant is the one a request launches.
    """
    launches = 0
    with on_torch_device(torch_device):
        for family in copies:
            for (widest, unit, aligned), page_dtype in itertools.product(
                sorted(family.shapes()), family.page_dtypes
            ):
                _copy_one_page(torch_device, family, widest, unit, aligned, page_dtype)
                launches += 1
    return launches


def _copy_one_page(
    torch_device: torch.device,
    family: SliceCopies,
    widest: int,
    unit: int,
    aligned: bool,
    page_dtype: torch.dtype,
) -> None:
    """One page of `widest`-byte slices between staging at `unit` (or 16-byte) alignment and a
    KV page further in the same scratch, every address and length a multiple of `unit`."""
    from gpu_planner.kernels.head_gather import launch_gather_head_slices
    from gpu_planner.kernels.head_scatter import launch_scatter_head_slices

    page_bytes = family.page_size * widest
    kv_offset = -(-(page_bytes + _ALIGNMENT) // _ALIGNMENT) * _ALIGNMENT  # past the staged page
    scratch = cuda_runtime().empty_bytes(2 * _ALIGNMENT + kv_offset + page_bytes, torch_device)
    residue = 0 if aligned else unit
    start = (residue - scratch.data_ptr()) % _ALIGNMENT
    staging = scratch[start:]
    kv_address = staging.data_ptr() + kv_offset
    staged = unit % _ALIGNMENT  # the staged page's offset: brings the entries' gcd to `unit`
    pages = torch.zeros(1, dtype=page_dtype)
    if family.scatter:
        entries = [staged, page_bytes, widest, kv_address, page_bytes, widest, widest, 0]
        launch_scatter_head_slices(
            staging, pages, None, np.array([entries], dtype=np.int64), family.page_size
        )
    else:
        entries = [kv_address, page_bytes, widest, staged, page_bytes, widest, widest]
        launch_gather_head_slices(
            staging, pages, np.array([entries], dtype=np.int64), family.page_size
        )

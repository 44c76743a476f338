"""Compile every kernel variant the planner can launch, before any request needs one.

A Triton kernel compiles the first time it meets a new specialisation. The
kernels never specialise on sizes, counts or strides (`do_not_specialize`,
int64 scalars) nor on the alignment of caller tensors, so what remains is
finite: the page dtypes (int32/int64 of each page list) and the constexpr
flags (a device space or not, host slots or not). `warmup` launches each of
them once on tiny inputs through the real launchers, so it compiles exactly
what requests launch, into Triton's per-device cache.
"""

from __future__ import annotations

import itertools

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

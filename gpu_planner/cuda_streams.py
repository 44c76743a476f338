"""Where the planner's CUDA work runs: device guards, per-device side streams, device tables.

Triton launches on `torch.cuda.current_device()` and its current stream, and
a new thread starts on device 0, so every launch, allocation, copy and event
of a plan runs under `on_torch_device(pages' torch device)`. Reads of a finished plan run
on a side stream of that device that waits on the plan's event alone, so a
reader never waits for unrelated work queued on its own stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.errors import PlanValidationError


def torch_device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    """The one torch device of `tensors`; mixed torch devices are a `PlanValidationError`."""
    torch_devices = {tensor.device for tensor in tensors}
    if len(torch_devices) > 1:
        raise PlanValidationError(
            f"tensors on {sorted(map(str, torch_devices))}: one plan's tensors must share a "
            "torch device"
        )
    return torch_devices.pop()


def on_torch_device(torch_device: torch.device) -> contextlib.AbstractContextManager:
    """Make `torch_device` current for CUDA launches and allocations; nothing on the CPU.

    A device with an index goes through the calling thread's cached
    `DeviceContext` (no index lookup, no torch guard); a bare "cuda" through
    torch's guard, which resolves it to the current device.
    """
    runtime = cuda_runtime()
    if not runtime.runs_on_device(torch_device):
        return contextlib.nullcontext()
    if torch_device.type == "cuda" and torch_device.index is None:
        return runtime.device_guard(torch_device)
    return runtime.device_context(torch_device)


def side_stream(torch_device: torch.device) -> torch.cuda.Stream:
    """This process's side stream on `torch_device` (created once), for reading finished plans."""
    runtime = cuda_runtime()
    if torch_device.type == "cuda" and torch_device.index is None:
        torch_device = torch.device("cuda", runtime.current_device())
    return runtime.side_stream(torch_device)


def copy_tables_to_device(
    host_tables: dict[str, np.ndarray], torch_device: torch.device
) -> dict[str, torch.Tensor]:
    """Per-buffer int64 tables on `torch_device`, in one copy complete when this returns.

    The tables are packed into one pinned array and copied on the device's side
    stream; the host waits on that copy's event alone, once per layout and
    device. Afterwards any stream of any thread may read them without ordering.
    """
    names = list(host_tables)
    num_buffers = len(host_tables[names[0]])
    # Rows padded to an even length start 16-byte aligned, whatever the buffer count:
    # the expansion kernel then sees one pointer alignment (one compiled variant).
    packed = torch.zeros((len(names), num_buffers + num_buffers % 2), dtype=torch.int64)
    for row, name in enumerate(names):
        packed[row, :num_buffers] = torch.from_numpy(np.asarray(host_tables[name], np.int64))
    if torch_device.type != "cuda":
        return {name: packed[row, :num_buffers] for row, name in enumerate(names)}
    with torch.cuda.device(torch_device):
        stream = side_stream(torch_device)
        with torch.cuda.stream(stream):
            gpu_tables = packed.pin_memory().to(torch_device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        copied.synchronize()
    return {name: gpu_tables[row, :num_buffers] for row, name in enumerate(names)}

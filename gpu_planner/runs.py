"""group_runs: contiguous runs of (src, dst) page pairs for the host and device spaces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_planner import cpu_backend
from gpu_planner.cuda_streams import on_torch_device
from gpu_planner.inputs import (
    Backend,
    IndexLike,
    PageList,
    as_tensor,
    collect_pages,
    raise_recorded_negative_page,
    resolve_backend,
)
from gpu_planner.pinned_copies import copy_to_host
from gpu_planner.status import NUM_SLOTS

if TYPE_CHECKING:  # the kernels import triton; load them only when they run
    from gpu_planner.kernels.launcher import LaunchTarget
    from gpu_planner.kernels.run_scan import RunTables


@dataclass
class SpaceRuns:
    """Runs of one destination space, in page order (int64 tensors on the input's device)."""

    src_starts: torch.Tensor
    dst_starts: torch.Tensor
    lengths: torch.Tensor
    batch_run_offsets: torch.Tensor  # [num_batches + 1]: first run of each batch, then the count

    def __len__(self) -> int:
        return self.lengths.numel()


@dataclass
class Runs:
    """Run plans for the host space and, when device pages were given, the device space."""

    host: SpaceRuns
    device: SpaceRuns | None
    num_batches: int


def group_runs(
    src_pages: IndexLike,
    dst_pages: IndexLike,
    dst_device_pages: IndexLike | None = None,
    max_batch_pages: int = 0,
    backend: Backend | None = None,
) -> Runs:
    """Maximal runs where src and dst pages both step by +1, never crossing a batch cut.

    Args:
        src_pages, dst_pages: int32/int64 [num_pages] source and host-space
            destination pages (tensors on one torch device, or NumPy arrays).
        dst_device_pages: int32/int64 [num_pages] device-space destination
            pages, or None for a host-space plan only.
        max_batch_pages: batch cut in pages (0 = none), as in `plan_transfer`.
        backend: as in `plan_transfer`.

    Returns:
        `Runs(host, device, num_batches)`: one `SpaceRuns` per page space (int64
        src_starts, dst_starts, lengths [runs] and batch_run_offsets
        [num_batches + 1], on the input's torch device). This reads the run
        counts back to return exact tensors; `plan_transfer` does not.

    Example:
        >>> gp.group_runs(np.array([3, 4, 9]), np.array([0, 1, 2])).host.lengths
        tensor([2, 1])
    """
    request = collect_pages(src_pages, dst_pages, dst_device_pages, max_batch_pages)
    if resolve_backend(backend, request.torch_device) == "cpu":
        spaces = cpu_backend.group_runs(request.pages, request.batch_pages)
        space_runs = [_space_runs_on(request.torch_device, *space) for space in spaces]
    else:
        space_runs = _group_runs_with_kernels(request.pages, request.batch_pages)
    return Runs(
        host=space_runs[0],
        device=space_runs[1] if len(space_runs) > 1 else None,
        num_batches=request.num_batches,
    )


def read_device_counts(
    runs: RunTables, stream: torch.cuda.Stream | None = None
) -> list[np.ndarray]:
    """Each space's batch run offsets, read with the status word in one small host read.

    The copy runs on `stream` (default: the current one) and the host waits
    on it alone. Raises the first negative page the kernels recorded.
    """
    # Copied out of the pinned block, so the block is free for the next read at once.
    metadata = copy_to_host(runs.metadata, stream).numpy().copy()
    raise_recorded_negative_page(metadata[:NUM_SLOTS])
    return list(metadata[NUM_SLOTS:].reshape(runs.num_spaces, -1))


def _space_runs_on(
    torch_device: torch.device, table: np.ndarray, batch_run_offsets: np.ndarray
) -> SpaceRuns:
    """The CPU backend's run table of one space as `SpaceRuns` on `torch_device`."""
    src_starts, dst_starts, lengths = (
        torch.from_numpy(np.ascontiguousarray(row)).to(torch_device) for row in table
    )
    batch_run_offsets = torch.from_numpy(batch_run_offsets).to(torch_device)
    return SpaceRuns(src_starts, dst_starts, lengths, batch_run_offsets)


def launch_runs(
    pages: dict[str, PageList],
    batch_pages: int,
    workspace: torch.Tensor | None = None,
    num_buffers: int = 0,
    target: LaunchTarget | None = None,
) -> RunTables:
    """Launch the run-grouping kernels on validated page lists (current device and stream).

    The tables are pieces of `workspace` (with room for `num_buffers` buffers'
    descriptors), or of a new one; `target` launches through cached kernels.
    """
    from gpu_planner.kernels.run_scan import launch_group_runs

    tensors = {name: as_tensor(values) for name, values in pages.items()}
    return launch_group_runs(
        tensors["src_pages"],
        tensors["dst_pages"],
        tensors.get("dst_device_pages"),
        batch_pages,
        workspace,
        num_buffers,
        target,
    )


def _group_runs_with_kernels(pages: dict[str, PageList], batch_pages: int) -> list[SpaceRuns]:
    with on_torch_device(as_tensor(pages["src_pages"]).device):
        runs = launch_runs(pages, batch_pages)
        batch_run_offsets = read_device_counts(runs)
    run_counts = [int(offsets[-1]) for offsets in batch_run_offsets]
    return [
        SpaceRuns(
            src_starts=runs.src_starts[space, :count],
            dst_starts=runs.dst_starts[space, :count],
            lengths=runs.page_ends[space, :count] - runs.page_starts[space, :count],
            batch_run_offsets=runs.batch_run_offsets[space],
        )
        for space, count in enumerate(run_counts)
    ]

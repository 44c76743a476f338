"""plan_transfer: page lists + buffer layout -> batch-major transfer descriptors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from gpu_planner import cpu_backend
from gpu_planner.errors import PlanValidationError
from gpu_planner.inputs import (
    Backend,
    IndexLike,
    PageList,
    check_max_batch_pages,
    collect_pages,
    resolve_backend,
)
from gpu_planner.layout import BufferLayout
from gpu_planner.profiling import nvtx_range
from gpu_planner.runs import launch_runs, read_device_counts
from gpu_planner.staging import copy_to_host

Descriptors = tuple[list[int], list[int], list[int]]


class BufferBatch(NamedTuple):
    """One buffer's descriptors within one batch: one call in per-buffer submission."""

    batch: int
    buffer: int
    srcs: list[int]
    dsts: list[int]
    lens: list[int]


class TransferPlan:
    """Descriptors for one request: `(src_addr, dst_addr, length)` columns, batch-major.

    On CUDA the plan is built by kernels and stays on the device until it is
    first read; that read (`materialize`) fetches the status and counts once,
    raises any error the kernels recorded, and copies exactly the descriptors
    into pinned host memory.
    """

    def __init__(self, layout: BufferLayout, num_batches: int) -> None:
        self.layout = layout
        self.num_batches = num_batches
        self._device_state: tuple | None = None
        self._host_columns: np.ndarray | None = None  # int64 [3, N], set once on the host
        self._columns: torch.Tensor | None = None  # a tensor view of it, made on first request
        self._batch_offsets: np.ndarray | None = None
        self._batch_run_offsets: list[np.ndarray] | None = None

    def _set_run_counts(self, batch_run_offsets: list[np.ndarray]) -> int:
        """Record each space's runs per batch; return the descriptor count they imply."""
        self._batch_run_offsets = batch_run_offsets
        host_runs, device_runs = batch_run_offsets[0], batch_run_offsets[-1]
        self._batch_offsets = (
            self.layout.num_host_buffers * host_runs + self.layout.num_device_buffers * device_runs
        )
        return int(self._batch_offsets[-1])

    def materialize(self) -> TransferPlan:
        """Bring the descriptors to the host (no-op when already there); raise recorded errors."""
        if self._host_columns is not None:
            return self
        device_descriptors, device_runs, status = self._device_state
        with nvtx_range("materialize/read_counts"):
            status, batch_run_offsets = read_device_counts(status, device_runs)
        self._raise_out_of_bounds(status, device_runs)
        total = self._set_run_counts(batch_run_offsets)
        # The kernel packs the columns at stride `total`: one exact contiguous copy.
        with nvtx_range("materialize/copy_descriptors"):
            host = copy_to_host(device_descriptors[: 3 * total]).view(3, total)
        self._host_columns = host.numpy()
        self._device_state = None
        return self

    def _raise_out_of_bounds(self, status: np.ndarray, device_runs) -> None:
        """Raise the first out-of-bounds descriptor the expansion kernel recorded, if any."""
        from gpu_planner.kernels.status import NO_ERROR, OUT_OF_BOUNDS

        if status[OUT_OF_BOUNDS] != NO_ERROR:
            key, side_bit = divmod(int(status[OUT_OF_BOUNDS]), 2)
            buffer, run = divmod(key, device_runs.capacity)
            space = int(self.layout.space[buffer])
            side = "src" if side_bit else "dst"
            starts = device_runs.src_starts if side_bit else device_runs.dst_starts
            page_start = int(starts[space, run])
            num_pages = int(device_runs.page_ends[space, run] - device_runs.page_starts[space, run])
            raise self.layout.bounds_error(buffer, side, page_start, num_pages)

    @property
    def columns(self) -> torch.Tensor:
        """int64 [3, num_descriptors] in host memory: src_addrs, dst_addrs, lengths."""
        if self._columns is None:
            self._columns = torch.from_numpy(self.columns_array())
        return self._columns

    def columns_array(self) -> np.ndarray:
        """`columns` as the NumPy array it views (what the list hand-off reads)."""
        return self.materialize()._host_columns

    @property
    def descriptors(self) -> torch.Tensor:
        """int64 [num_descriptors, 3] view: one (src_addr, dst_addr, length) row per descriptor."""
        return self.columns.T

    @property
    def src_addrs(self) -> torch.Tensor:
        return self.columns[0]

    @property
    def dst_addrs(self) -> torch.Tensor:
        return self.columns[1]

    @property
    def lengths(self) -> torch.Tensor:
        return self.columns[2]

    @property
    def batch_offsets(self) -> torch.Tensor:
        """int64 [num_batches + 1]: first descriptor of each batch, then the total."""
        return torch.from_numpy(self.materialize()._batch_offsets)

    @property
    def num_descriptors(self) -> int:
        return int(self.materialize()._batch_offsets[-1])

    @property
    def total_bytes(self) -> int:
        return int(self.columns_array()[2].sum())

    def batches(self) -> Iterator[Descriptors]:
        """One (srcs, dsts, lens) list triple per non-empty batch: one Mooncake call each."""
        columns = self.columns_array()
        length_groups = self.layout.length_groups
        for _, start, end, runs in self._batch_runs():
            if end > start:
                group_lengths = self._group_lengths(columns, start, runs)
                lens: list[int] = []
                for group in length_groups:
                    lens += group_lengths[group]  # one exact resize and copy per buffer
                yield columns[0, start:end].tolist(), columns[1, start:end].tolist(), lens

    def buffer_batches(self) -> Iterator[BufferBatch]:
        """One `BufferBatch` per batch and buffer with descriptors, in plan order."""
        columns = self.columns_array()
        length_groups = self.layout.length_groups
        for batch, start, _, runs in self._batch_runs():
            group_lengths = self._group_lengths(columns, start, runs)
            for buffer in range(self.layout.num_buffers):
                first, count = self._piece(buffer, start, runs)
                if count:
                    srcs, dsts = columns[:2, first : first + count].tolist()
                    lens = list(group_lengths[length_groups[buffer]])
                    yield BufferBatch(batch, buffer, srcs, dsts, lens)

    def _batch_runs(self) -> Iterator[tuple[int, int, int, tuple[int, ...]]]:
        """Per batch: (batch, first descriptor, end, runs of each space), as Python ints."""
        offsets = self._batch_offsets.tolist()
        run_offsets = [space_offsets.tolist() for space_offsets in self._batch_run_offsets]
        for batch in range(len(offsets) - 1):
            runs = tuple(space[batch + 1] - space[batch] for space in run_offsets)
            yield batch, offsets[batch], offsets[batch + 1], runs

    def _piece(self, buffer: int, batch_start: int, runs: tuple[int, ...]) -> tuple[int, int]:
        """(first descriptor, count) of `buffer` in the batch starting at `batch_start`."""
        host_before, device_before = self.layout.buffers_before[buffer]
        first = batch_start + host_before * runs[0] + device_before * runs[-1]
        return first, runs[self.layout.buffer_spaces[buffer]]

    def _group_lengths(
        self, columns: np.ndarray, batch_start: int, runs: tuple[int, ...]
    ) -> list[list[int]]:
        """Each length group's lengths in one batch, as Python ints.

        Buffers of one length group (same space and item length) have equal
        lengths, so they share one list of int objects: building `lens` costs
        a pointer copy per descriptor instead of an int allocation.
        """
        pieces = [
            self._piece(leader, batch_start, runs) for leader in self.layout.length_group_leaders
        ]
        return [columns[2, first : first + count].tolist() for first, count in pieces]


def plan_transfer(
    src_pages: IndexLike,
    dst_pages: IndexLike,
    layout: BufferLayout,
    dst_device_pages: IndexLike | None = None,
    max_batch_pages: int = 0,
    backend: Backend | None = None,
) -> TransferPlan:
    """Plan every buffer's descriptors for one request's page lists.

    Buffers with `layout.dst_is_device` use `dst_device_pages`, the others
    `dst_pages`. With `max_batch_pages > 0` the pages are cut into batches of
    that many pages (one Mooncake call each); runs never cross a cut.
    """
    pages, device = collect_pages(src_pages, dst_pages, dst_device_pages)
    check_max_batch_pages(max_batch_pages)
    first_device_buffer = layout.first_device_buffer()
    if first_device_buffer is not None and dst_device_pages is None:
        raise PlanValidationError(
            f"dst_device_pages: buffer {first_device_buffer} is device-backed "
            f"(dst_is_device[{first_device_buffer}]) but no device-space pages were given"
        )
    if not layout.num_device_buffers:
        pages.pop("dst_device_pages", None)
    num_pages = len(pages["src_pages"])
    batch_pages = cpu_backend.batch_page_count(num_pages, max_batch_pages)
    plan = TransferPlan(layout, num_batches=-(-num_pages // batch_pages))
    if resolve_backend(backend, device) == "cpu":
        with nvtx_range("plan_transfer/cpu"):
            _plan_on_cpu(plan, pages, max_batch_pages)
    else:
        with nvtx_range("plan_transfer/kernels"):
            _plan_with_kernels(plan, pages, batch_pages)
        if device.type != "cuda":
            plan.materialize()
    return plan


def _plan_on_cpu(plan: TransferPlan, pages: dict[str, PageList], max_batch_pages: int) -> None:
    planned = cpu_backend.plan_descriptors(plan.layout, pages, max_batch_pages)
    plan._batch_run_offsets = planned.batch_run_offsets
    plan._batch_offsets = planned.batch_offsets
    plan._host_columns = planned.columns


def _plan_with_kernels(plan: TransferPlan, pages: dict[str, PageList], batch_pages: int) -> None:
    from gpu_planner.kernels.expand_descriptors import launch_expand_descriptors

    runs, status = launch_runs(pages, batch_pages)
    layout = plan.layout
    descriptors = launch_expand_descriptors(
        layout.tables(status.device),
        layout.num_host_buffers,
        layout.num_device_buffers,
        runs,
        status,
        check_bounds=layout.has_bounds,
    )
    plan._device_state = (descriptors, runs, status)

"""plan_transfer: page lists + buffer layout -> batch-major transfer descriptors."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from gpu_planner import cpu_backend
from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.cuda_streams import on_torch_device, side_stream
from gpu_planner.descriptors import HostDescriptors
from gpu_planner.errors import PlanValidationError
from gpu_planner.inputs import (
    INT64_MAX,
    Backend,
    IndexLike,
    PageList,
    collect_pages,
    resolve_backend,
)
from gpu_planner.layout import BufferLayout
from gpu_planner.pinned_copies import copy_to_host_async
from gpu_planner.profiling import nvtx_range
from gpu_planner.runs import launch_runs, read_device_counts
from gpu_planner.status import recorded_out_of_bounds

if TYPE_CHECKING:  # the kernels import triton; load them only when they run
    from gpu_planner.kernels.run_scan import RunTables


def exact_total(lengths: np.ndarray) -> int:
    """The sum of int64 `lengths` (each >= 0) as an exact Python int.

    An int64 sum wraps (four 2**62-byte descriptors sum to 0), so when the
    largest length times the count could pass 2**63 - 1, the high and low 32
    bits are summed apart: each sum fits in 64 bits for fewer than 2**32 values.
    """
    if lengths.size == 0:
        return 0
    if int(lengths.max()) <= INT64_MAX // lengths.size:  # no partial sum can wrap
        return int(lengths.sum())
    high = int((lengths >> 32).sum())
    low = int((lengths & 0xFFFF_FFFF).sum(dtype=np.uint64))
    return (high << 32) + low


class PlanPiece(NamedTuple):
    """One Mooncake call's descriptors: a whole batch, or one buffer's part of a batch.

    The columns are int64 views of the plan's host columns, or Python lists
    (`TransferPlan.pieces(lists=True)`, for engines without the arrays API).
    """

    batch: int
    buffer: int | None  # None: every buffer of the batch
    srcs: list[int] | np.ndarray
    dsts: list[int] | np.ndarray
    lens: list[int] | np.ndarray


@dataclass(frozen=True)
class LaunchedPlan:
    """A kernel plan before its first read: run tables on the device, and where they ran.

    `done` is recorded on the planning stream after the last run kernel; None
    on the CPU (Triton interpreter) and inside CUDA-graph capture, where the
    reader orders itself after its own current stream instead.
    """

    runs: RunTables
    torch_device: torch.device
    done: torch.cuda.Event | None


class TransferPlan:
    """Descriptors for one request: `(src_addr, dst_addr, length)` columns, batch-major.

    Built by one constructor per backend: `from_host` (CPU backend: complete)
    and `from_launched` (Triton kernels: run tables still on the device). A
    launched plan is read when first used (`materialize`), from any thread and
    under any current stream: one small read of the status and run counts,
    exact descriptor expansion, one copy into pinned host memory.
    """

    def __init__(
        self, layout: BufferLayout, num_batches: int, state: HostDescriptors | LaunchedPlan
    ) -> None:
        self.layout = layout
        self.num_batches = num_batches
        self._state = state
        self._read_lock = threading.Lock()
        self._columns: torch.Tensor | None = None  # a tensor view of the host columns

    @classmethod
    def from_host(
        cls, layout: BufferLayout, num_batches: int, host: HostDescriptors
    ) -> TransferPlan:
        """A complete plan whose descriptors are already in host memory."""
        return cls(layout, num_batches, host)

    @classmethod
    def from_launched(
        cls, layout: BufferLayout, num_batches: int, launched: LaunchedPlan
    ) -> TransferPlan:
        """A plan whose run kernels were launched; descriptors are made on first read."""
        return cls(layout, num_batches, launched)

    @property
    def _host(self) -> HostDescriptors:
        return self.materialize()._state

    def materialize(self) -> TransferPlan:
        """Bring the descriptors to the host (no-op when already there); raise recorded errors."""
        if isinstance(self._state, LaunchedPlan):
            with self._read_lock:
                if isinstance(self._state, LaunchedPlan):
                    self._state = self._read(self._state)
        return self

    def _read(self, launched: LaunchedPlan) -> HostDescriptors:
        """Status and counts, exact expansion, one copy; on a stream that waits on `done` only."""
        from gpu_planner.kernels.expand_descriptors import launch_expand_descriptors

        runs, layout = launched.runs, self.layout
        with on_torch_device(launched.torch_device), _reading_stream(launched) as stream:
            with nvtx_range("materialize/read_counts"):
                batch_run_offsets = read_device_counts(runs, stream)
            run_counts = [int(offsets[-1]) for offsets in batch_run_offsets]
            with nvtx_range("materialize/expand"):
                descriptors = launch_expand_descriptors(
                    layout.tables(launched.torch_device),
                    layout.num_host_buffers,
                    layout.num_device_buffers,
                    runs,
                    run_counts,
                )
            with nvtx_range("materialize/copy_descriptors"):
                (columns, status), copied = copy_to_host_async([descriptors, runs.status], stream)
                if copied is not None:
                    copied.synchronize()
        self._raise_out_of_bounds(status.numpy(), runs)
        host_runs, device_runs = batch_run_offsets[0], batch_run_offsets[-1]
        batch_offsets = layout.num_host_buffers * host_runs
        batch_offsets += layout.num_device_buffers * device_runs
        return HostDescriptors(
            columns=columns.numpy().reshape(3, -1),
            batch_offsets=batch_offsets,
            batch_run_offsets=batch_run_offsets,
        )

    def _raise_out_of_bounds(self, status: np.ndarray, device_runs) -> None:
        """Raise the first out-of-bounds descriptor the expansion kernel recorded, if any."""
        recorded = recorded_out_of_bounds(status, device_runs.capacity)
        if recorded is not None:
            buffer, run, side = recorded
            space = int(self.layout.space[buffer])
            starts = device_runs.src_starts if side == "src" else device_runs.dst_starts
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
        return self._host.columns

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
        return torch.from_numpy(self._host.batch_offsets)

    @property
    def num_descriptors(self) -> int:
        return int(self._host.batch_offsets[-1])

    @property
    def total_bytes(self) -> int:
        """The bytes of every descriptor: an exact Python int (descriptors may overlap)."""
        return exact_total(self.columns_array()[2])

    def pieces(self, per_buffer: bool = False, lists: bool = False) -> Iterator[PlanPiece]:
        """The plan's Mooncake calls in order: one per non-empty batch, or per batch and buffer.

        The columns are contiguous int64 views of the host columns (what
        Mooncake's `*_arrays` methods take: no list is built), or with `lists`
        Python lists (its list API). Buffers of one length group (same space
        and item length) have equal lengths, so their lists share one list of
        int objects: building `lens` costs a pointer copy per descriptor
        instead of an int allocation.
        """
        columns = self.columns_array()
        for batch, start, end, runs in self._batch_runs():
            group_lengths = self._group_lengths(columns, start, runs) if lists else None
            if per_buffer:
                yield from self._buffer_pieces(columns, batch, start, runs, group_lengths)
            elif end > start:
                yield self._batch_piece(columns, batch, start, end, group_lengths)

    def _batch_piece(
        self,
        columns: np.ndarray,
        batch: int,
        start: int,
        end: int,
        group_lengths: list[list[int]] | None,
    ) -> PlanPiece:
        if group_lengths is None:
            return PlanPiece(batch, None, *columns[:, start:end])
        lens: list[int] = []
        for group in self.layout.length_groups:
            lens += group_lengths[group]  # one exact resize and copy per buffer
        return PlanPiece(batch, None, *columns[:2, start:end].tolist(), lens)

    def _buffer_pieces(
        self,
        columns: np.ndarray,
        batch: int,
        start: int,
        runs: tuple[int, ...],
        group_lengths: list[list[int]] | None,
    ) -> Iterator[PlanPiece]:
        for buffer in range(self.layout.num_buffers):
            first, count = self._piece(buffer, start, runs)
            if not count:
                continue
            if group_lengths is None:
                yield PlanPiece(batch, buffer, *columns[:, first : first + count])
            else:
                lens = list(group_lengths[self.layout.length_groups[buffer]])
                yield PlanPiece(batch, buffer, *columns[:2, first : first + count].tolist(), lens)

    def _batch_runs(self) -> Iterator[tuple[int, int, int, tuple[int, ...]]]:
        """Per batch: (batch, first descriptor, end, runs of each space), as Python ints."""
        host = self._host
        offsets = host.batch_offsets.tolist()
        run_offsets = [space_offsets.tolist() for space_offsets in host.batch_run_offsets]
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
    """Plan every buffer's `(src_addr, dst_addr, length)` descriptors for one request.

    A run is a maximal stretch where both the source page and the destination
    page step by +1; each buffer gets one descriptor per run of its
    destination page space, buffer-major, runs in page order.

    Args:
        src_pages: int32/int64 [num_pages] prefill (source) pages.
        dst_pages: int32/int64 [num_pages] destination pages in the host page
            space (every buffer whose `layout.dst_is_device` is false).
        layout: the peer pair's buffers (`BufferLayout`).
        dst_device_pages: int32/int64 [num_pages] destination pages in the
            device page space; required when any buffer is device-backed.
        max_batch_pages: cut the pages into batches of this many (one Mooncake
            call each; runs never cross a cut); 0 = one batch.
        backend: None picks Triton for CUDA tensors, the compiled CPU loops for
            CPU tensors and NumPy arrays; "triton" on CPU needs TRITON_INTERPRET=1.
            Page lists are torch tensors (any stride) or NumPy arrays, on one
            torch device.

    Returns:
        A `TransferPlan`. On CUDA nothing is read back until it is first used.

    Raises:
        PlanValidationError (BoundsError for a registered length) naming the
        argument, buffer and page at fault, before any byte moves; on CUDA
        kernel-found errors raise at the plan's first read.

    Example:
        >>> layout = gp.BufferLayout([1 << 40], [1 << 41], [4096], dst_lens=[4096 * 16])
        >>> plan = gp.plan_transfer(np.array([3, 4, 9]), np.array([0, 1, 2]), layout)
        >>> plan.descriptors.tolist()  # runs [3, 4] -> [0, 1] and [9] -> [2]
        [[1099511640064, 2199023255552, 8192], [1099511664640, 2199023263744, 4096]]
    """
    request = collect_pages(src_pages, dst_pages, dst_device_pages, max_batch_pages)
    pages = request.pages
    first_device_buffer = layout.first_device_buffer()
    if first_device_buffer is not None and dst_device_pages is None:
        raise PlanValidationError(
            f"dst_device_pages: buffer {first_device_buffer} is device-backed "
            f"(dst_is_device[{first_device_buffer}]) but no device-space pages were given"
        )
    if not layout.num_device_buffers:
        pages.pop("dst_device_pages", None)
    if resolve_backend(backend, request.torch_device) == "cpu":
        with nvtx_range("plan_transfer/cpu"):
            host = cpu_backend.plan_descriptors(layout, pages, request.batch_pages)
        return TransferPlan.from_host(layout, request.num_batches, host)
    with nvtx_range("plan_transfer/kernels"):
        launched = _launch(layout, pages, request.batch_pages, request.torch_device)
        plan = TransferPlan.from_launched(layout, request.num_batches, launched)
    if not cuda_runtime().runs_on_device(request.torch_device):
        plan.materialize()
    return plan


def _launch(
    layout: BufferLayout, pages: dict[str, PageList], batch_pages: int, torch_device: torch.device
) -> LaunchedPlan:
    """Launch the run kernels on the pages' device and current stream; record their event."""
    from gpu_planner.kernels.launch_config import MAX_GRID_Y

    if layout.num_buffers > MAX_GRID_Y:
        raise PlanValidationError(
            f"layout: {layout.num_buffers} buffers; the Triton backend plans at most "
            f"{MAX_GRID_Y} (one grid row each), use backend='cpu'"
        )
    runtime = cuda_runtime()
    with on_torch_device(torch_device):
        runs = launch_runs(pages, batch_pages)
        done = None
        if runtime.runs_on_device(torch_device) and not runtime.is_capturing():
            done = runtime.new_event()
            done.record()
    return LaunchedPlan(runs, torch_device, done)


@contextlib.contextmanager
def _reading_stream(launched: LaunchedPlan) -> Iterator[torch.cuda.Stream | None]:
    """The stream a plan is read on: the device's side stream, ordered after the plan only.

    With no `done` event (a plan captured in a CUDA graph and replayed), the
    side stream waits for the reader's current stream, where the replay ran.
    """
    runtime = cuda_runtime()
    if not runtime.runs_on_device(launched.torch_device):
        yield None
        return
    stream = side_stream(launched.torch_device)
    if launched.done is None:
        stream.wait_stream(runtime.current_stream(launched.torch_device))
    else:
        stream.wait_event(launched.done)
    with runtime.stream_guard(stream):
        yield stream

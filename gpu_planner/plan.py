"""plan_transfer: page lists + buffer layout -> batch-major transfer descriptors."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from gpu_planner import cpu_backend
from gpu_planner.cuda_runtime import DeviceContext, cuda_runtime
from gpu_planner.descriptors import HostDescriptors
from gpu_planner.errors import PlanValidationError
from gpu_planner.inputs import (
    INT64_MAX,
    Backend,
    IndexLike,
    PageList,
    collect_pages,
    raise_recorded_negative_page,
    resolve_backend,
)
from gpu_planner.layout import BufferLayout
from gpu_planner.pinned_copies import copy_to_host_async
from gpu_planner.profiling import nvtx_range
from gpu_planner.runs import launch_runs
from gpu_planner.status import NUM_SLOTS, recorded_out_of_bounds

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
    """A kernel plan before its first read: run tables and descriptors on the device.

    `done` is recorded on the planning stream after the last kernel; None on
    the CPU (Triton interpreter) and inside CUDA-graph capture, where the
    reader orders itself after its own current stream instead. `context` is
    the planning thread's device context (None where tensors do not take the
    CUDA path); `workspace` came from `context.workspaces` (None: the plan's own).
    """

    runs: RunTables
    torch_device: torch.device
    done: torch.cuda.Event | None
    context: DeviceContext | None = None
    workspace: torch.Tensor | None = None


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
        self._give_back = None  # gives a pooled workspace back if the plan is dropped unread
        if isinstance(state, LaunchedPlan) and state.workspace is not None:
            pool = state.context.workspaces
            self._give_back = weakref.finalize(self, pool.give, state.workspace, state.done)

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
        """Status, counts and descriptors in one copy and one host wait; raise recorded errors.

        The copy takes the status word, the run counts and as many descriptor
        entries as recent plans of this workspace class needed; a plan that
        needs more (larger than those before it) copies the rest after a
        second wait. The workspace goes back to its pool afterwards.
        """
        try:
            with (
                _device_scope(launched),
                _reading_stream(launched) as stream,
                nvtx_range("materialize/copy"),
            ):
                return self._copy_descriptors(launched, stream)
        finally:
            if self._give_back is not None and self._give_back.detach() is not None:
                launched.context.workspaces.give(launched.workspace)

    def _copy_descriptors(self, launched: LaunchedPlan, stream) -> HostDescriptors:
        runs, layout = launched.runs, self.layout
        pool = None if launched.context is None else launched.context.workspaces
        size_class = runs.descriptors.numel()
        expected = 0 if pool is None else pool.expected_entries.get(size_class, 0)
        speculative = min(size_class, expected + expected // 8)
        (metadata, prefix), copied = copy_to_host_async(
            [runs.metadata, runs.descriptors[:speculative]], stream
        )
        if copied is not None:
            copied.synchronize()
        metadata = metadata.numpy().copy()
        raise_recorded_negative_page(metadata[:NUM_SLOTS])
        batch_run_offsets = list(metadata[NUM_SLOTS:].reshape(runs.num_spaces, -1))
        host_runs, device_runs = batch_run_offsets[0], batch_run_offsets[-1]
        batch_offsets = layout.num_host_buffers * host_runs
        batch_offsets += layout.num_device_buffers * device_runs
        entries = 3 * int(batch_offsets[-1])
        if pool is not None:
            pool.expected_entries[size_class] = max(entries, expected * 7 // 8)
        self._raise_out_of_bounds(metadata[:NUM_SLOTS], runs)
        if entries <= speculative:
            columns = prefix[:entries]
        else:
            (columns,), copied = copy_to_host_async([runs.descriptors[:entries]], stream)
            if copied is not None:
                copied.synchronize()
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
    """Launch the run and expansion kernels on the pages' device and current stream.

    Four launches through cached compiled kernels into a pooled workspace,
    then the plan's event; nothing is read back.
    """
    from gpu_planner.kernels.expand_descriptors import launch_expand_descriptors
    from gpu_planner.kernels.launch_config import MAX_GRID_Y
    from gpu_planner.kernels.launcher import LaunchTarget
    from gpu_planner.kernels.run_scan import workspace_bytes

    if layout.num_buffers > MAX_GRID_Y:
        raise PlanValidationError(
            f"layout: {layout.num_buffers} buffers; the Triton backend plans at most "
            f"{MAX_GRID_Y} (one grid row each), use backend='cpu'"
        )
    tables = layout.tables(torch_device)
    runtime = cuda_runtime()
    if not runtime.runs_on_device(torch_device):  # the interpreter on CPU tensors: read at once
        runs = launch_runs(pages, batch_pages, num_buffers=layout.num_buffers)
        launch_expand_descriptors(tables, layout.num_host_buffers, layout.num_device_buffers, runs)
        return LaunchedPlan(runs, torch_device, None)
    context = runtime.device_context(torch_device)
    with context:
        capturing = runtime.is_capturing()
        workspace = None
        if not capturing:  # a captured graph keeps its tensors: no pooled workspace for it
            num_pages = len(pages["src_pages"])
            num_spaces = 1 + ("dst_device_pages" in pages)
            num_batches = -(-num_pages // batch_pages)
            nbytes = workspace_bytes(num_pages, num_spaces, num_batches, layout.num_buffers)
            workspace = context.workspaces.take(nbytes)
        target = LaunchTarget(context.index, runtime.launch_stream(context.index))
        runs = launch_runs(pages, batch_pages, workspace, layout.num_buffers, target)
        launch_expand_descriptors(
            tables, layout.num_host_buffers, layout.num_device_buffers, runs, target=target
        )
        done = None
        if not capturing:
            done = runtime.new_event()
            done.record()
    return LaunchedPlan(runs, torch_device, done, context, workspace)


def _device_scope(launched: LaunchedPlan) -> contextlib.AbstractContextManager:
    """The plan's device made current (its thread's cached context), or nothing on the host."""
    if launched.context is None:
        return contextlib.nullcontext()
    return launched.context.runtime.device_context(launched.torch_device)


@contextlib.contextmanager
def _reading_stream(launched: LaunchedPlan) -> Iterator[torch.cuda.Stream | None]:
    """The stream a plan is read on: the device's side stream, ordered after the plan only.

    With no `done` event (a plan captured in a CUDA graph and replayed), the
    side stream waits for the reader's current stream, where the replay ran.
    """
    if launched.context is None:
        yield None
        return
    runtime = launched.context.runtime
    context = runtime.device_context(launched.torch_device)  # the reading thread's
    stream = context.side_stream
    if launched.done is None:
        stream.wait_stream(runtime.current_stream(launched.torch_device))
    else:
        stream.wait_event(launched.done)
    with runtime.stream_guard(stream):
        yield stream

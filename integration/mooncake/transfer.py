"""Mooncake submit loop: one call per plan batch, in order, bounded in time, in either direction.

Push (`MooncakeSender`, sglang's model): the prefill side writes its sources
into the decode side's destinations with `batch_transfer_sync_write`. Pull
(`MooncakeReader`): the decode side reads the prefill side's sources into its
own destinations with `batch_transfer_sync_read`. A plan's (src, dst, len)
triples are the same in both; only which end is local changes.

Mooncake's own failure behaviour over TCP (measured with 0.3.13, see the tests):
a peer that has exited (connection refused or reset) fails the call with -1
within milliseconds, but a peer that is alive and stalled (stopped, swapped
out, wedged) keeps a synchronous call blocked for `MC_TCP_PROGRESS_TIMEOUT_SEC`
(30 s) per stalled slice, one after another: minutes for a large batch. So the
loop submits each batch from a worker thread and waits at most
`batch_timeout_s` for it; on expiry it raises `TransferTimeoutError` while the
abandoned call finishes (or fails) inside Mooncake in the background. Local
buffers must stay registered until then.

Mooncake's TCP transport also rejects a call with more descriptors than its
per-peer queue holds (`MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`, about 2k by
default): status -1, after part of the batch may already have been written
(see `engine.tcp_queue_env`).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from itertools import groupby
from operator import attrgetter

from gpu_planner.integration.mooncake import handoff
from gpu_planner.plan import BufferBatch, TransferPlan
from gpu_planner.profiling import nvtx_range

Batch = tuple[handoff.Column, handoff.Column, handoff.Column]


class TransferError(RuntimeError):
    """A Mooncake batch failed; earlier batches were confirmed, later ones never submitted."""

    def __init__(self, message: str, batch_index: int, confirmed_bytes: int) -> None:
        super().__init__(message)
        self.batch_index = batch_index
        self.confirmed_bytes = confirmed_bytes


class TransferTimeoutError(TransferError):
    """A Mooncake batch did not complete within the sender's `batch_timeout_s`."""


class MooncakeTransfer:
    """Submits a plan's batches between the local engine and a peer; stops at the first failure.

    `MooncakeSender` writes and `MooncakeReader` reads; both share this loop
    and its error semantics. `buffer_workers > 0` submits each batch as one
    call per buffer through a thread pool of that size (sglang's
    custom-memory-pool path); the batch completes when all its buffers have.
    `batch_timeout_s=None` waits without bound (and submits from the calling
    thread when there are no buffer workers). Batches reach Mooncake through
    `handoff`: descriptor arrays when the engine takes them, else lists
    (`handoff_path`, detected from the engine unless given).
    """

    operation = "transfer with"  # how error messages name the direction
    direction: handoff.Direction

    def __init__(
        self,
        engine,
        peer_session_id: str,
        *,
        buffer_workers: int = 0,
        batch_timeout_s: float | None = 60.0,
        handoff_path: handoff.Path | None = None,
    ) -> None:
        if buffer_workers < 0:
            raise ValueError(f"buffer_workers: must be >= 0, got {buffer_workers}")
        if batch_timeout_s is not None and batch_timeout_s <= 0:
            raise ValueError(f"batch_timeout_s: must be > 0 or None, got {batch_timeout_s}")
        self.engine = engine
        self.peer = peer_session_id
        self.buffer_workers = buffer_workers
        self.batch_timeout_s = batch_timeout_s
        self.handoff_path = handoff_path or handoff.handoff_path(engine, self.direction)
        self._engine_call = handoff.engine_call(engine, self.direction, self.handoff_path)
        self._pool = self._new_pool() if buffer_workers or batch_timeout_s is not None else None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _new_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(
            max_workers=max(self.buffer_workers, 1), thread_name_prefix="gpu-planner-mooncake"
        )

    def close(self) -> None:
        """Release the worker threads (without waiting for a timed-out call)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def submit(self, plan: TransferPlan) -> int:
        """Submit every batch of `plan`; return the bytes moved. Raises `TransferError`."""
        if self.buffer_workers:
            return self.submit_buffer_batches(handoff.buffer_batches(plan, self.handoff_path))
        return self.submit_batches(handoff.batches(plan, self.handoff_path))

    def submit_batches(self, batches: Iterable[Batch]) -> int:
        """Submit precomputed (srcs, dsts, lens) batches, one Mooncake call each, in order.

        They must have `handoff_path`'s form (`handoff.batches(plan, path)`).
        """
        return self._submit_groups(
            [BufferBatch(index, -1, *batch)] for index, batch in enumerate(batches)
        )

    def submit_buffer_batches(self, pieces: Iterable[BufferBatch]) -> int:
        """Submit `plan.buffer_batches()` pieces in plan order, one call per piece.

        The pieces of one batch run concurrently on the buffer workers; the next
        batch starts when all of them have succeeded.
        """
        return self._submit_groups(
            list(group) for _, group in groupby(pieces, key=attrgetter("batch"))
        )

    def _submit_groups(self, groups: Iterable[list[BufferBatch]]) -> int:
        confirmed = 0
        with nvtx_range(f"{type(self).__name__}/submit"):
            for index, pieces in enumerate(groups):
                nbytes = sum(handoff.column_total(piece.lens) for piece in pieces)
                with nvtx_range(f"{type(self).__name__}/batch {index}"):
                    status = self._submit_group(pieces, index, confirmed)
                if status != 0:
                    descriptors = sum(len(piece.lens) for piece in pieces)
                    raise TransferError(
                        f"Mooncake batch {index} ({self.operation} {self.peer}) failed with "
                        f"status {status} ({descriptors} descriptors, {nbytes} bytes); {confirmed} "
                        f"bytes of the {index} earlier batches were confirmed, later batches not "
                        "submitted",
                        batch_index=index,
                        confirmed_bytes=confirmed,
                    )
                confirmed += nbytes
        return confirmed

    def _submit_group(self, pieces: list[BufferBatch], index: int, confirmed: int) -> int:
        """Run one batch's calls; the first non-zero status, or 0."""
        if self._pool is None:
            return self._call(pieces[0].srcs, pieces[0].dsts, pieces[0].lens)
        futures = [
            self._pool.submit(self._call, piece.srcs, piece.dsts, piece.lens) for piece in pieces
        ]
        _, pending = concurrent.futures.wait(futures, timeout=self.batch_timeout_s)
        if pending:
            # The stuck calls keep their threads; later batches get fresh ones.
            self.close()
            self._pool = self._new_pool()
            raise TransferTimeoutError(
                f"Mooncake batch {index} ({self.operation} {self.peer}): {len(pending)} of "
                f"{len(futures)} calls still running after {self.batch_timeout_s} s (is the peer "
                f"stalled?); {confirmed} bytes of the {index} earlier batches were confirmed",
                batch_index=index,
                confirmed_bytes=confirmed,
            )
        return next((status for status in (f.result() for f in futures) if status != 0), 0)

    def _call(self, srcs: handoff.Column, dsts: handoff.Column, lens: handoff.Column) -> int:
        """One Mooncake call for (srcs, dsts, lens) in the plan's convention; its status."""
        return self._engine_call(self.peer, srcs, dsts, lens)


class MooncakeSender(MooncakeTransfer):
    """Push: writes the plan's sources (local memory) into its destinations (the peer's)."""

    operation = "write to"
    direction = "write"


class MooncakeReader(MooncakeTransfer):
    """Pull: reads the plan's sources (the peer's memory) into its destinations (local)."""

    operation = "read from"
    direction = "read"

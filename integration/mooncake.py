"""Mooncake send loop: one `batch_transfer_sync_write` per plan batch, in order, bounded in time.

Mooncake's own failure behaviour over TCP (measured with 0.3.13, see the tests):
a peer that has exited (connection refused or reset) fails the call with -1
within milliseconds, but a peer that is alive and stalled (stopped, swapped
out, wedged) keeps a synchronous call blocked for `MC_TCP_PROGRESS_TIMEOUT_SEC`
(30 s) per stalled slice, one after another: minutes for a large batch. So the
sender submits each batch from a worker thread and waits at most
`batch_timeout_s` for it; on expiry it raises `TransferTimeoutError` while the
abandoned call finishes (or fails) inside Mooncake in the background. Source
buffers must stay registered until then.

Mooncake's TCP transport also rejects a call with more descriptors than its
per-peer queue holds (`MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`, about 2k by
default): status -1, after part of the batch may already have been written.
sglang-sized batches (1024 pages x 61 buffers x runs) exceed that, so
`start_engine` raises the limit unless the environment already sets it.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterable, Iterator

import nvtx

from gpu_planner.plan import TransferPlan

Batch = tuple[list[int], list[int], list[int]]
BufferPiece = tuple[int, list[int], list[int], list[int]]

LOCALHOST = "127.0.0.1"
TCP_QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
NVTX_DOMAIN = "gpu_planner"


def nvtx_range(name: str) -> nvtx.annotate:
    """An NVTX range in gpu_planner's domain (about a microsecond when no profiler listens)."""
    return nvtx.annotate(name, domain=NVTX_DOMAIN)


class TransferError(RuntimeError):
    """A Mooncake batch failed; earlier batches were confirmed, later ones never submitted."""

    def __init__(self, message: str, batch_index: int, confirmed_bytes: int) -> None:
        super().__init__(message)
        self.batch_index = batch_index
        self.confirmed_bytes = confirmed_bytes


class TransferTimeoutError(TransferError):
    """A Mooncake batch did not complete within the sender's `batch_timeout_s`."""


def start_engine(host: str = LOCALHOST, max_queued_transfers: int = 65535):
    """A Mooncake `TransferEngine` on `host` with the TCP transport and P2P handshake metadata.

    `max_queued_transfers` (descriptors one call may hold per peer; Mooncake
    0.3.13 ignores values above 65535) applies unless
    `MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER` is set.
    """
    from mooncake.engine import TransferEngine

    os.environ.setdefault(TCP_QUEUE_ENV, str(max_queued_transfers))
    engine = TransferEngine()
    status = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if status != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, tcp) returned {status}")
    return engine


def register_buffer(engine, ptr: int, nbytes: int) -> None:
    """Register `nbytes` at `ptr` with `engine`; raise when Mooncake refuses."""
    status = engine.register_memory(ptr, nbytes)
    if status != 0:
        raise RuntimeError(f"Mooncake register_memory({ptr:#x}, {nbytes}) returned {status}")


def session_id(engine, host: str = LOCALHOST) -> str:
    """The peer name other engines use to reach `engine` (P2P handshake: host:rpc_port)."""
    return f"{host}:{engine.get_rpc_port()}"


def _batches_of_buffer_pieces(pieces: Iterable[BufferPiece]) -> Iterator[list[BufferPiece]]:
    """Group `plan.buffer_batches()` by batch: within a batch the buffer index only grows."""
    batch: list[BufferPiece] = []
    for piece in pieces:
        if batch and piece[0] <= batch[-1][0]:
            yield batch
            batch = []
        batch.append(piece)
    if batch:
        yield batch


class MooncakeSender:
    """Submits a plan's batches to one peer, stopping at the first failed batch.

    `buffer_workers > 0` submits each batch as one call per buffer through a
    thread pool of that size (sglang's custom-memory-pool path); the batch
    completes when all its buffers have. `batch_timeout_s=None` waits without
    bound (and submits from the calling thread when there are no buffer workers).
    """

    def __init__(
        self,
        engine,
        peer_session_id: str,
        *,
        buffer_workers: int = 0,
        batch_timeout_s: float | None = 60.0,
    ) -> None:
        if buffer_workers < 0:
            raise ValueError(f"buffer_workers: must be >= 0, got {buffer_workers}")
        if batch_timeout_s is not None and batch_timeout_s <= 0:
            raise ValueError(f"batch_timeout_s: must be > 0 or None, got {batch_timeout_s}")
        self.engine = engine
        self.peer = peer_session_id
        self.buffer_workers = buffer_workers
        self.batch_timeout_s = batch_timeout_s
        self._pool = self._new_pool() if buffer_workers or batch_timeout_s is not None else None

    def __enter__(self) -> MooncakeSender:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _new_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(
            max_workers=max(self.buffer_workers, 1), thread_name_prefix="gpu-planner-send"
        )

    def close(self) -> None:
        """Release the worker threads (without waiting for a timed-out call)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def send(self, plan: TransferPlan) -> int:
        """Submit every batch of `plan`; return the bytes written. Raises `TransferError`."""
        if self.buffer_workers:
            return self.send_buffer_batches(plan.buffer_batches())
        return self.send_batches(plan.batches())

    def send_batches(self, batches: Iterable[Batch]) -> int:
        """Submit precomputed (srcs, dsts, lens) batches, one Mooncake call each, in order."""
        return self._send_groups([(-1, *batch)] for batch in batches)

    def send_buffer_batches(self, pieces: Iterable[BufferPiece]) -> int:
        """Submit (buffer, srcs, dsts, lens) pieces in plan order, one call per piece.

        The pieces of one batch run concurrently on the buffer workers; the next
        batch starts when all of them have succeeded.
        """
        return self._send_groups(_batches_of_buffer_pieces(pieces))

    def _send_groups(self, groups: Iterable[list[BufferPiece]]) -> int:
        confirmed = 0
        with nvtx_range("gpu_planner.send"):
            for index, pieces in enumerate(groups):
                nbytes = sum(sum(piece[3]) for piece in pieces)
                with nvtx_range(f"gpu_planner.batch {index}"):
                    status = self._submit(pieces, index, confirmed)
                if status != 0:
                    descriptors = sum(len(piece[3]) for piece in pieces)
                    raise TransferError(
                        f"Mooncake batch {index} to {self.peer} failed with status {status} "
                        f"({descriptors} descriptors, {nbytes} bytes); {confirmed} bytes of "
                        f"the {index} earlier batches were confirmed, later batches not submitted",
                        batch_index=index,
                        confirmed_bytes=confirmed,
                    )
                confirmed += nbytes
        return confirmed

    def _submit(self, pieces: list[BufferPiece], index: int, confirmed: int) -> int:
        """Run one batch's calls; the first non-zero status, or 0."""
        if self._pool is None:
            return self._write(pieces[0])
        futures = [self._pool.submit(self._write, piece) for piece in pieces]
        _, pending = concurrent.futures.wait(futures, timeout=self.batch_timeout_s)
        if pending:
            # The stuck calls keep their threads; later batches get fresh ones.
            self.close()
            self._pool = self._new_pool()
            raise TransferTimeoutError(
                f"Mooncake batch {index} to {self.peer}: {len(pending)} of {len(futures)} calls "
                f"still running after {self.batch_timeout_s} s (is the peer stalled?); "
                f"{confirmed} bytes of the {index} earlier batches were confirmed",
                batch_index=index,
                confirmed_bytes=confirmed,
            )
        return next((status for status in (f.result() for f in futures) if status != 0), 0)

    def _write(self, piece: BufferPiece) -> int:
        _, srcs, dsts, lens = piece
        return self.engine.batch_transfer_sync_write(self.peer, srcs, dsts, lens)

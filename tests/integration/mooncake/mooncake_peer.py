"""Two real Mooncake engines on 127.0.0.1 (TCP, P2P handshake): this process and a peer process.

`peer_process` starts a peer (`engine.engine_process`) that starts its own engine with
`engine.start_engine`, registers buffers filled with seeded random bytes, and
serves its session id, buffer addresses and (on request) buffer contents over
a pipe. `local_engine` starts this process's engine with its own buffers.
Tests stall the peer with SIGSTOP (`Peer.stop`, which returns only once the
kernel reports it stopped) and kill it with SIGKILL; every wait is bounded and
the peer is killed when its context exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

import numpy as np

import gpu_planner as gp
from gpu_planner.integration.mooncake import MooncakeReader, MooncakeSender, MooncakeTransfer
from gpu_planner.integration.mooncake.engine import (
    TCP_QUEUE_DEFAULT,
    engine_process,
    register_buffer,
    session_id,
    start_engine,
    tcp_queue_env,
)
from gpu_planner.testing import fragmented_pages

LOCALHOST = "127.0.0.1"
REPLY_TIMEOUT_S = 60.0  # engine start or a buffer dump; both take well under a second
CONTENTS = "contents"
LOCAL_SEED, PEER_SEED = 0, 1


def initial_bytes(seed: int, index: int, nbytes: int) -> np.ndarray:
    """Buffer `index`'s initial bytes on the side seeded `seed`: random, distinct per buffer."""
    return np.random.default_rng([seed, index]).integers(0, 256, nbytes, dtype=np.uint8)


def _serve(connection: Connection, nbytes: list[int], seed: int) -> None:
    """The peer process: engine, registered buffers, then answer `CONTENTS` until the pipe ends."""
    engine = start_engine(LOCALHOST)
    buffers = [initial_bytes(seed, index, size) for index, size in enumerate(nbytes)]
    for buffer in buffers:
        register_buffer(engine, buffer.ctypes.data, buffer.nbytes)
    connection.send((session_id(engine, LOCALHOST), [buffer.ctypes.data for buffer in buffers]))
    with contextlib.suppress(EOFError):  # the test process closed the pipe or exited
        while connection.recv() == CONTENTS:
            connection.send([buffer.tobytes() for buffer in buffers])


@dataclasses.dataclass
class Peer:
    """A live peer process: its engine's session id and its registered buffers."""

    process: multiprocessing.Process
    connection: Connection
    session_id: str
    ptrs: list[int]
    nbytes: list[int]
    seed: int

    def initial(self) -> list[np.ndarray]:
        """The peer's buffers as they were before any transfer."""
        return [initial_bytes(self.seed, index, n) for index, n in enumerate(self.nbytes)]

    def contents(self) -> list[np.ndarray]:
        """The peer's buffers now."""
        self.connection.send(CONTENTS)
        if not self.connection.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"peer {self.process.pid} sent no contents in {REPLY_TIMEOUT_S} s")
        return [np.frombuffer(data, dtype=np.uint8) for data in self.connection.recv()]

    def stop(self) -> None:
        """SIGSTOP the peer; return once it is stopped (signals arrive asynchronously)."""
        os.kill(self.process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while _process_state(self.process.pid) != "T":
            assert time.monotonic() < deadline, f"process {self.process.pid} did not stop"
            time.sleep(0.001)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        self.process.kill()
        self.process.join()


def _process_state(pid: int) -> str:
    """The one-letter state from /proc/PID/stat (after the parenthesised command name)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


@contextlib.contextmanager
def peer_process(nbytes: list[int], seed: int = PEER_SEED) -> Iterator[Peer]:
    """Spawn a peer with buffers of `nbytes` bytes; kill it on exit."""
    connection, child_end = multiprocessing.Pipe()
    process = engine_process(_serve, (child_end, nbytes, seed))
    process.start()
    child_end.close()
    try:
        if not connection.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"peer {process.pid} did not start in {REPLY_TIMEOUT_S} s")
        peer_session, ptrs = connection.recv()
        yield Peer(process, connection, peer_session, ptrs, nbytes, seed)
    finally:
        process.kill()  # SIGKILL ends a stopped process too
        process.join()
        connection.close()


@dataclasses.dataclass
class Local:
    """This process's engine and registered buffers."""

    engine: object
    buffers: list[np.ndarray]

    @property
    def ptrs(self) -> list[int]:
        return [buffer.ctypes.data for buffer in self.buffers]


@contextlib.contextmanager
def local_engine(
    nbytes: list[int], seed: int = LOCAL_SEED, environment: dict[str, str] | None = None
) -> Iterator[Local]:
    """An engine in this process with buffers of `nbytes` bytes, started with `environment`.

    The engine has Mooncake's default TCP queue unless `environment` sets
    another, whatever this process's environment says.
    """
    engine = start_engine(
        LOCALHOST, environment={**tcp_queue_env(TCP_QUEUE_DEFAULT), **(environment or {})}
    )
    buffers = [initial_bytes(seed, index, size) for index, size in enumerate(nbytes)]
    for buffer in buffers:
        register_buffer(engine, buffer.ctypes.data, buffer.nbytes)
    try:
        yield Local(engine, buffers)
    finally:
        for buffer in buffers:
            engine.unregister_memory(buffer.ctypes.data)


def expected_after(
    before: list[np.ndarray],
    sources: list[np.ndarray],
    src_pages: np.ndarray,
    dst_pages: list[np.ndarray],
    item_len: int,
) -> list[np.ndarray]:
    """Destination buffers once page `src_pages[i]` of each source buffer went to `dst_pages[b][i]`.

    Computed from the pages alone, independently of any plan.
    """
    after = []
    for buffer, source, pages in zip(before, sources, dst_pages, strict=True):
        target = buffer.reshape(-1, item_len).copy()
        target[pages] = source.reshape(-1, item_len)[src_pages]
        after.append(target.reshape(-1))
    return after


def changed_pages(actual: list[np.ndarray], expected: list[np.ndarray], item_len: int) -> int:
    """How many pages of all buffers differ from `expected`."""
    return sum(
        int((a.reshape(-1, item_len) != e.reshape(-1, item_len)).any(axis=1).sum())
        for a, e in zip(actual, expected, strict=True)
    )


def page_request(
    num_pages: int, pool_pages: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src pages, host dst pages, device dst pages) of one fragmented request."""
    rng = np.random.default_rng(seed)
    return tuple(fragmented_pages(num_pages, 4.0, rng, pool_pages=pool_pages) for _ in range(3))


class HookedEngine:
    """A real Mooncake engine whose calls are recorded, with `hook` run before call `at_call`.

    It has the engine's list and array (0.3.14) methods, so the hand-off picks
    the same path as for the engine itself. Reads and writes are both recorded
    as (srcs, dsts, lens) lists in the plan's convention: for a read the
    peer's addresses are the sources.
    """

    def __init__(self, engine, at_call: int = -1, hook: Callable[[], None] = lambda: None):
        self.engine = engine
        self.at_call = at_call
        self.hook = hook
        self.calls: list[tuple[list[int], list[int], list[int]]] = []
        self._lock = threading.Lock()

    def _before_call(self, srcs, dsts, lens) -> None:
        with self._lock:
            number = len(self.calls)
            self.calls.append(tuple(np.asarray(column).tolist() for column in (srcs, dsts, lens)))
        if number == self.at_call:
            self.hook()

    def _write(self, method: str, peer: str, srcs, dsts, lens) -> int:
        self._before_call(srcs, dsts, lens)
        return getattr(self.engine, method)(peer, srcs, dsts, lens)

    def _read(self, method: str, peer: str, local_addrs, peer_addrs, lens) -> int:
        self._before_call(peer_addrs, local_addrs, lens)
        return getattr(self.engine, method)(peer, local_addrs, peer_addrs, lens)

    def batch_transfer_sync_write(self, *args) -> int:
        return self._write("batch_transfer_sync_write", *args)

    def batch_transfer_sync_read(self, *args) -> int:
        return self._read("batch_transfer_sync_read", *args)

    def batch_transfer_sync_write_arrays(self, *args) -> int:
        return self._write("batch_transfer_sync_write_arrays", *args)

    def batch_transfer_sync_read_arrays(self, *args) -> int:
        return self._read("batch_transfer_sync_read_arrays", *args)


@dataclasses.dataclass
class Sides:
    """One transfer's ends: this process submits; push writes to the peer, pull reads from it."""

    direction: str  # "push" or "pull"
    local: Local
    peer: Peer

    @property
    def transfer(self) -> type[MooncakeTransfer]:
        return MooncakeSender if self.direction == "push" else MooncakeReader

    def layout(self, item_len: int, dst_is_device: list[bool] | None = None) -> gp.BufferLayout:
        """Buffer i of the source side to buffer i of the destination side, bounded by both."""
        src, dst = (self.local.ptrs, self.peer.ptrs)
        src_lens, dst_lens = ([b.nbytes for b in self.local.buffers], self.peer.nbytes)
        if self.direction == "pull":
            src, dst, src_lens, dst_lens = dst, src, dst_lens, src_lens
        return gp.BufferLayout(
            src, dst, [item_len] * len(src), dst_is_device, src_lens=src_lens, dst_lens=dst_lens
        )

    def sources(self) -> list[np.ndarray]:
        """The source buffers' bytes (never written by a transfer)."""
        return (
            [b.copy() for b in self.local.buffers]
            if self.direction == "push"
            else self.peer.initial()
        )

    def destination_initial(self) -> list[np.ndarray]:
        if self.direction == "push":
            return self.peer.initial()
        return [
            initial_bytes(LOCAL_SEED, index, b.nbytes) for index, b in enumerate(self.local.buffers)
        ]

    def after_calls(self, calls: list[tuple[list[int], list[int], list[int]]]) -> list[np.ndarray]:
        """The destination buffers once exactly `calls` ((srcs, dsts, lens), plan order) moved."""
        src_ptrs, dst_ptrs = self.local.ptrs, self.peer.ptrs
        if self.direction == "pull":
            src_ptrs, dst_ptrs = dst_ptrs, src_ptrs
        sources, after = self.sources(), self.destination_initial()
        for srcs, dsts, lens in calls:
            for src, dst, length in zip(srcs, dsts, lens, strict=True):
                src_buffer = _buffer_at(src_ptrs, src)
                dst_buffer = _buffer_at(dst_ptrs, dst)
                src_at, dst_at = src - src_ptrs[src_buffer], dst - dst_ptrs[dst_buffer]
                after[dst_buffer][dst_at : dst_at + length] = sources[src_buffer][
                    src_at : src_at + length
                ]
        return after

    def destination(self) -> list[np.ndarray]:
        """The destination buffers' bytes now."""
        return (
            self.peer.contents()
            if self.direction == "push"
            else [b.copy() for b in self.local.buffers]
        )


def _buffer_at(ptrs: list[int], address: int) -> int:
    """The buffer, of those starting at `ptrs`, that holds `address` (the last one before it)."""
    return max((ptr, buffer) for buffer, ptr in enumerate(ptrs) if ptr <= address)[1]


@contextlib.contextmanager
def two_sides(
    direction: str,
    src_nbytes: list[int],
    dst_nbytes: list[int],
    environment: dict[str, str] | None = None,
) -> Iterator[Sides]:
    """This process and a peer process, holding the source and destination buffers of `direction`.

    The peer is killed before this process's buffers are unregistered, so a
    call still in flight fails rather than touching freed memory.
    """
    local_nbytes, peer_nbytes = (src_nbytes, dst_nbytes)
    if direction == "pull":
        local_nbytes, peer_nbytes = peer_nbytes, local_nbytes
    with (
        local_engine(local_nbytes, LOCAL_SEED, environment) as local,
        peer_process(peer_nbytes, PEER_SEED) as peer,
    ):
        yield Sides(direction, local, peer)

"""Two real processes for the Mooncake tests: this one plans and submits, a spawned peer serves.

Push: this process is prefill and the peer is the demo's decode process
(`run_push_decode`), which registers its buffers with a real Mooncake engine,
sends sglang-layout frames, and verifies every byte after `PrefillSide.finish`.
Pull: this process is decode and the peer is the demo's prefill process
(`run_pull_prefill`), which registers its source buffers and sends its
registration and source pages. Tests drive the planning side step by step so
they can plan wrongly, fail the peer, or inspect the engine calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import gpu_planner as gp
from gpu_planner.integration.demo.config import DemoConfig
from gpu_planner.integration.demo.run import run_pull_prefill, run_push_decode
from gpu_planner.integration.demo.sides import DecodeSide, PrefillSide, pair_layout
from gpu_planner.integration.mooncake import MooncakeTransfer, TransferError
from gpu_planner.integration.sglang.frames import KVRegistration, SourcePages, TransferRequest

SMALL = DemoConfig(
    buffers=6,
    device_fraction=0.5,
    tokens=1024,
    page_size=16,
    item_len=128,
    mean_run=4.0,
    max_batch_pages=7,
    timeout_s=30.0,
)


def small_config(**changes) -> DemoConfig:
    """A demo configuration that moves a few hundred KiB: fast on two CPU cores."""
    return dataclasses.replace(SMALL, **changes)


def _as_tensor(pages: np.ndarray | None) -> torch.Tensor | None:
    return None if pages is None else torch.from_numpy(np.array(pages))


@dataclasses.dataclass
class DecodePeer:
    """Push: a live decode process and what it announced; this process is prefill."""

    prefill: PrefillSide
    process: object
    registration: KVRegistration
    request: TransferRequest

    @property
    def engine(self):
        return self.prefill.engine

    @property
    def session_id(self) -> str:
        return self.request.session_id

    def layout(self) -> gp.BufferLayout:
        return pair_layout(self.prefill.registration(), self.registration)

    def plan(
        self, dst_pages: np.ndarray, dst_device_pages: np.ndarray | None, max_batch_pages: int
    ) -> gp.TransferPlan:
        """gpu_planner's plan from prefill's source pages to the given destination pages."""
        return gp.plan_transfer(
            torch.from_numpy(self.prefill.src_pages),
            _as_tensor(dst_pages),
            self.layout(),
            _as_tensor(dst_device_pages),
            max_batch_pages=max_batch_pages,
        )

    def plan_request(self, max_batch_pages: int) -> gp.TransferPlan:
        """The plan of the request decode announced."""
        return self.plan(self.request.host_pages, self.request.device_pages, max_batch_pages)


@dataclasses.dataclass
class PrefillPeer:
    """Pull: a live prefill process and what it announced; this process is decode."""

    decode: DecodeSide
    process: object
    registration: KVRegistration
    source: SourcePages

    @property
    def engine(self):
        return self.decode.engine

    @property
    def session_id(self) -> str:
        return self.registration.session_id

    def layout(self) -> gp.BufferLayout:
        return pair_layout(self.registration, self.decode.registration())

    def plan(self, src_pages: np.ndarray, max_batch_pages: int) -> gp.TransferPlan:
        """gpu_planner's plan from the given source pages to decode's own pages (its device)."""
        pages = self.decode.pages.on_device
        device_pages = pages.device if self.decode.has_device_buffers else None
        return gp.plan_transfer(
            _as_tensor(src_pages).to(pages.host.device),
            pages.host,
            self.layout(),
            device_pages,
            max_batch_pages=max_batch_pages,
        )

    def plan_request(self, max_batch_pages: int) -> gp.TransferPlan:
        """The plan of the request prefill announced."""
        return self.plan(self.source.pages, max_batch_pages)


def _stop_peer(process) -> None:
    # The peer has reported (or is of no further use): stopped or not, it goes.
    process.kill()
    process.join()


@contextlib.contextmanager
def decode_peer(config: DemoConfig) -> Iterator[DecodePeer]:
    """Push: spawn the demo's decode process and receive its registration and request."""
    with PrefillSide(config) as prefill:
        process = prefill.spawn_peer(run_push_decode)
        try:
            registration, request = prefill.receive_metadata()
            yield DecodePeer(prefill, process, registration, request)
        finally:
            _stop_peer(process)


@contextlib.contextmanager
def prefill_peer(config: DemoConfig) -> Iterator[PrefillPeer]:
    """Pull: spawn the demo's prefill process and receive its registration and source pages."""
    with DecodeSide(config) as decode:
        process = decode.spawn_peer(run_pull_prefill)
        try:
            registration, source = decode.receive_source()
            yield PrefillPeer(decode, process, registration, source)
        finally:
            _stop_peer(process)


class HookedEngine:
    """A real Mooncake engine whose calls are recorded, with a hook before call `at_call`.

    Reads and writes are both recorded as (src_addrs, dst_addrs, lens) in the
    plan's convention: for a read the peer's addresses are the sources.
    """

    def __init__(self, engine, at_call: int = -1, hook: Callable[[], None] = lambda: None):
        self.engine = engine
        self.at_call = at_call
        self.hook = hook
        self.calls: list[tuple[list[int], list[int], list[int]]] = []
        self._lock = threading.Lock()

    def _before_call(self, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        with self._lock:
            number = len(self.calls)
            self.calls.append((srcs, dsts, lens))
        if number == self.at_call:
            self.hook()

    def batch_transfer_sync_write(self, peer: str, srcs, dsts, lens) -> int:
        self._before_call(srcs, dsts, lens)
        return self.engine.batch_transfer_sync_write(peer, srcs, dsts, lens)

    def batch_transfer_sync_read(self, peer: str, local_addrs, peer_addrs, lens) -> int:
        self._before_call(peer_addrs, local_addrs, lens)
        return self.engine.batch_transfer_sync_read(peer, local_addrs, peer_addrs, lens)


def kill_process(process) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.join()


def stop_process(process) -> None:
    """SIGSTOP the peer and return only once it is stopped (signals arrive asynchronously)."""
    os.kill(process.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10.0
    while _process_state(process.pid) != "T":
        assert time.monotonic() < deadline, f"process {process.pid} did not stop"
        time.sleep(0.001)


def _process_state(pid: int) -> str:
    """The one-letter state from /proc/PID/stat (after the parenthesised command name)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def faulty_transfer(
    peer_context: Callable, transfer: type[MooncakeTransfer], fault: Callable
) -> tuple[gp.TransferPlan, TransferError]:
    """Apply `fault` to the peer process as batch 3 starts; return the plan and the error.

    `peer_context` is `decode_peer` (push, with `MooncakeSender`) or
    `prefill_peer` (pull, with `MooncakeReader`).
    """
    config = small_config(buffers=4, item_len=16384, max_batch_pages=4, timeout_s=20.0)
    with peer_context(config) as peer:
        plan = peer.plan_request(max_batch_pages=4)
        engine = HookedEngine(peer.engine, at_call=3, hook=functools.partial(fault, peer.process))
        with (
            transfer(engine, peer.session_id, batch_timeout_s=2.0) as submitter,
            pytest.raises(TransferError) as caught,
        ):
            submitter.submit(plan)
    return plan, caught.value

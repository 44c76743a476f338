"""Two real processes for the Mooncake tests: this one as prefill, a spawned decode peer.

The decode peer is the demo's own (`run_push_decode`): it registers its
buffers with a real Mooncake engine, sends sglang-layout frames, and verifies
every byte after `PrefillSide.finish`. Tests drive the prefill side step by
step so they can plan wrongly, fail the peer, or inspect the engine calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch
from gpu_planner.integration.demo import DemoConfig, PrefillSide, run_push_decode
from gpu_planner.integration.frames import KVRegistration, TransferRequest

import gpu_planner as gp

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


@dataclasses.dataclass
class DecodePeer:
    """A live decode process and what it announced."""

    prefill: PrefillSide
    process: object
    registration: KVRegistration
    request: TransferRequest

    def layout(self) -> gp.BufferLayout:
        return self.prefill.layout(self.registration)

    def plan(
        self, dst_pages: np.ndarray, dst_device_pages: np.ndarray | None, max_batch_pages: int
    ) -> gp.TransferPlan:
        """gpu_planner's plan from prefill's source pages to the given destination pages."""
        return gp.plan_transfer(
            torch.from_numpy(self.prefill.src_pages),
            torch.from_numpy(np.array(dst_pages)),
            self.layout(),
            None if dst_device_pages is None else torch.from_numpy(np.array(dst_device_pages)),
            max_batch_pages=max_batch_pages,
        )


@contextlib.contextmanager
def decode_peer(config: DemoConfig) -> Iterator[DecodePeer]:
    """Spawn the demo's decode process and receive its registration and request."""
    with PrefillSide(config) as prefill:
        process = prefill.spawn_decode(run_push_decode)
        try:
            registration, request = prefill.receive_metadata()
            yield DecodePeer(prefill, process, registration, request)
        finally:
            # The peer has reported (or is of no further use): stopped or not, it goes.
            process.kill()
            process.join()


class HookedEngine:
    """A real Mooncake engine whose calls are recorded, with a hook before call `at_call`."""

    def __init__(self, engine, at_call: int = -1, hook: Callable[[], None] = lambda: None):
        self.engine = engine
        self.at_call = at_call
        self.hook = hook
        self.calls: list[tuple[list[int], list[int], list[int]]] = []
        self._lock = threading.Lock()

    def batch_transfer_sync_write(self, peer: str, srcs, dsts, lens) -> int:
        with self._lock:
            number = len(self.calls)
            self.calls.append((srcs, dsts, lens))
        if number == self.at_call:
            self.hook()
        return self.engine.batch_transfer_sync_write(peer, srcs, dsts, lens)

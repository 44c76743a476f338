"""The whole send path: sglang's `_send_kvcache_generic` and the hooked one, into a real engine.

Both run on the same `MooncakeKVManager` state, through sglang's real
`MooncakeTransferEngine` wrapper around a real Mooncake engine (TCP). The
engine's call goes to a refusing peer (`REFUSING_PEER`, where nothing
listens): Mooncake fails it with -1 right after its binding has converted the
descriptors, so the figures hold everything up to the wire and nothing of the
wire. sglang's code makes one call per batch and stops at the first failure,
as does the hook, so on one-batch cases both do all their work.

A probe thread sleeps `GilProbe.INTERVAL_S` in a loop and records the longest
gap between its wake-ups during each timed call: the longest stretch in which
the send kept the GIL from other threads (sglang's scheduler among them).

Each send is timed twice: interleaved with the other (the harness's rule, the
headline: a load change hits both alike; each call follows the other send's,
whose memory churn it meets), and `alone`, its calls one after another (a
process that only ever runs this send). The two differ where a call's cost is
memory that must be faulted in: at page size 1 the engine's binding builds a
72-byte request per descriptor in fresh memory, which after sglang's send
(whose freed objects glibc keeps) is already mapped.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.harness import RepeatPolicy, Stage, measure_interleaved
from bench.inputs import BenchInput

REFUSING_PEER = "127.0.0.1:9"  # the discard port: nothing listens there
VARIANTS = ("sglang", "hooked")


class GilProbe:
    """A thread that wakes every INTERVAL_S and records the longest gap within a window."""

    INTERVAL_S = 50e-6

    def __init__(self) -> None:
        self._window_start = time.perf_counter()
        self._longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)

    def __enter__(self) -> GilProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(self.INTERVAL_S)
            now = time.perf_counter()
            gap = now - max(last, self._window_start)
            if gap > self._longest:
                self._longest = gap
            last = now

    def window(self, fn: Callable[[], Any]) -> tuple[float, float]:
        """Call `fn`; (its wall seconds, the longest probe gap while it ran)."""
        self._longest = 0.0
        self._window_start = start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        time.sleep(2 * self.INTERVAL_S)  # let the probe close the gap the call left open
        return elapsed, self._longest


@dataclasses.dataclass
class GilHolds:
    """The longest probe gap of each timed call of one send (warm-up calls included)."""

    probe: GilProbe
    holds: list[float] = dataclasses.field(default_factory=list)

    def timer(self, fn: Callable[[], Any]) -> float:
        """A harness timer: the call's wall seconds; its longest GIL hold is kept."""
        elapsed, hold = self.probe.window(fn)
        self.holds.append(hold)
        return elapsed


def send_path_available() -> str | None:
    """Why the send path cannot be measured here (sglang or Mooncake missing), or None."""
    try:
        import mooncake.engine  # noqa: F401
        import sglang.srt.disaggregation.mooncake.conn  # noqa: F401
    except Exception as error:  # absent, or its import chain fails on this machine
        return f"{type(error).__name__}: {error}"
    return None


class SendPathBench:
    """sglang's send and the hooked send on one manager whose engine is real and refused."""

    def __init__(self) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            MooncakeTransferEngine,
        )

        from gpu_planner import cpu_backend
        from gpu_planner.integration.sglang import send as sglang_send
        from gpu_planner.integration.sglang.testing import make_manager

        for name, value in (("MOONCAKE_PROTOCOL", "tcp"), ("MC_FORCE_TCP", "1")):
            os.environ.setdefault(name, value)
        self.wrapper = MooncakeTransferEngine("127.0.0.1")
        self.handoff = sglang_send.engine_send(self.wrapper)[0]
        self._original = inspect.unwrap(MooncakeKVManager._send_kvcache_generic)
        self._hook = sglang_send.send_kvcache_generic_hook
        cpu_backend.compile_kernels()  # as the plugin does at registration
        self._manager = make_manager(self.wrapper, mla=True)
        self._arguments: tuple[tuple, dict] | None = None

    def prepare(self, bench_input: BenchInput) -> None:
        self._manager.max_transfer_batch_indices = bench_input.case.batch_pages
        device_ptrs = {
            ptr
            for ptr, is_device in zip(bench_input.dst_ptrs, bench_input.dst_is_device, strict=True)
            if is_device
        }
        args = (
            REFUSING_PEER,
            bench_input.src_ptrs,
            bench_input.dst_ptrs,
            bench_input.item_lens,
            bench_input.src_pages,
            bench_input.dst_pages,
        )
        kwargs = {
            "executor": None,
            "force_flat": True,
            "dst_device_data_indices": bench_input.dst_device_pages,
            "dst_device_data_ptrs": device_ptrs or None,
        }
        self._arguments = (args, kwargs)

    def send_sglang(self) -> int:
        args, kwargs = self._arguments
        return self._original(self._manager, *args, **kwargs)

    def send_hooked(self) -> int:
        args, kwargs = self._arguments
        return self._hook(self._original, self._manager, *args, **kwargs)

    def measure(self, policy: RepeatPolicy) -> dict[str, Any]:
        """Both sends timed interleaved, then each alone, under the GIL probe.

        Their statuses must agree (-1: the refused peer).
        """
        statuses = {"sglang": self.send_sglang(), "hooked": self.send_hooked()}
        if statuses["sglang"] != statuses["hooked"] or statuses["sglang"] == 0:
            raise RuntimeError(f"send statuses {statuses}: expected the refused peer's -1 on both")
        sends = {"sglang": self.send_sglang, "hooked": self.send_hooked}
        with GilProbe() as probe:
            figures = measure_sends(probe, sends, policy)
            alone = {
                name: measure_sends(probe, {name: send}, policy)[name]
                for name, send in sends.items()
            }
        for variant in VARIANTS:
            figures[variant]["alone"] = alone[variant]
        figures["speedup_alone"] = alone["sglang"]["median"] / alone["hooked"]["median"]
        return {"handoff": self.handoff, "status": statuses["sglang"], **figures}


def measure_sends(
    probe: GilProbe, sends: dict[str, Callable[[], int]], policy: RepeatPolicy
) -> dict[str, Any]:
    """`sends` timed interleaved, each call's longest GIL hold seen by `probe`.

    Per send: its timing figures and `gil_hold`; with both sglang's and the
    hooked send, also `speedup` (sglang's median over the hooked one's).
    """
    holds = {name: GilHolds(probe) for name in sends}
    stages = {name: Stage(send, holds[name].timer) for name, send in sends.items()}
    timings = measure_interleaved(stages, policy)
    figures: dict[str, Any] = {
        name: {**timings[name].as_dict(), "gil_hold": gil_hold_figures(holds[name].holds)}
        for name in sends
    }
    if set(sends) == set(VARIANTS):
        figures["speedup"] = timings["sglang"].median / timings["hooked"].median
    return figures


def gil_hold_figures(holds: list[float]) -> dict[str, float]:
    """The longest probe gap per call: median over calls (the typical call) and the maximum."""
    return {"median": float(np.median(holds)), "max": float(max(holds)), "calls": len(holds)}

"""The whole send path: sglang's `_send_kvcache_generic` and the hooked one, into a real engine.

Both run on the same `MooncakeKVManager` state, through sglang's real
`MooncakeTransferEngine` wrapper around a real Mooncake engine (TCP). The
engine's call goes to a refusing peer (`REFUSING_PEER`, where nothing
listens): Mooncake fails it with -1 right after its binding has converted the
descriptors, so the figures hold everything up to the wire and nothing of the
wire. sglang's code makes one call per batch and stops at the first failure,
as does the hook, so on one-batch cases both do all their work.

Then, in calls of their own, `bench.gil.GilMonitor` records each call's
longest single GIL hold (read from CPython's GIL state; wall clock, and how
long the holder ran in it) and the longest wait of a ready thread for the GIL
(what sglang's scheduler would feel).

Each send is timed twice: interleaved with the other (the harness's rule, the
headline: a load change hits both alike; in its balanced orders a call follows
the other send's, whose memory churn it meets, or its own, as the two sends'
sample counts fall: `after` splits its samples by which), and `alone`, its
calls one after another (a process that only ever runs this send). The two
differ where a call's cost is memory that must be faulted in: at page size 1
the engine's binding copies the three columns (24 bytes per descriptor) into
fresh memory, which after sglang's send (whose freed objects glibc keeps) is
already mapped.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.gil import GilMonitor, GilWindow
from bench.harness import RepeatPolicy, Stage, measure_interleaved
from bench.inputs import BUFFER_STRIDE, BenchInput
from gpu_planner.integration.mooncake.engine import QUIET_ENV, TCP_ONLY_ENV, set_mooncake_defaults

REFUSING_PEER = "127.0.0.1:9"  # the discard port: nothing listens there
VARIANTS = ("sglang", "hooked")
GIL_CALLS = 30  # watched calls per send, at most


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
        set_mooncake_defaults(QUIET_ENV, TCP_ONLY_ENV)  # before sglang's wrapper starts one
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            MooncakeTransferEngine,
        )

        from bench.sglang_manager import make_manager
        from gpu_planner import cpu_backend
        from gpu_planner.integration.sglang import send as sglang_send
        from gpu_planner.integration.sglang.adapter import sglang_handoff
        from gpu_planner.integration.sglang.fallback import around

        self.wrapper = MooncakeTransferEngine("127.0.0.1")
        self.handoff = sglang_handoff(self.wrapper).form
        self._original = inspect.unwrap(MooncakeKVManager._send_kvcache_generic)
        self._hook = around(sglang_send.send_kvcache_generic_hook)
        cpu_backend.compile_kernels()  # as the plugin does at registration
        self._manager = make_manager(self.wrapper, mla=True)
        self._arguments: tuple[tuple, dict] | None = None

    def prepare(self, bench_input: BenchInput) -> None:
        self._manager.max_transfer_batch_indices = bench_input.case.batch_pages
        # The prefill registered every source buffer (the hook refuses reads outside them).
        kv_args = self._manager.kv_args
        kv_args.kv_data_ptrs = list(bench_input.src_ptrs)
        kv_args.kv_data_lens = [BUFFER_STRIDE] * len(bench_input.src_ptrs)
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
        """Both sends timed interleaved, then each alone, under the GIL monitor.

        Their statuses must agree (-1: the refused peer).
        """
        statuses = {"sglang": self.send_sglang(), "hooked": self.send_hooked()}
        if statuses["sglang"] != statuses["hooked"] or statuses["sglang"] == 0:
            raise RuntimeError(f"send statuses {statuses}: expected the refused peer's -1 on both")
        sends = {"sglang": self.send_sglang, "hooked": self.send_hooked}
        figures = measure_sends(sends, policy)
        alone = {name: measure_sends({name: send}, policy)[name] for name, send in sends.items()}
        for variant in VARIANTS:
            figures[variant]["alone"] = alone[variant]
        figures["speedup_alone"] = alone["sglang"]["median"] / alone["hooked"]["median"]
        return {"handoff": self.handoff, "status": statuses["sglang"], **figures}


def measure_sends(
    sends: dict[str, Callable[[], int]], policy: RepeatPolicy, keep_rounds: bool = False
) -> dict[str, Any]:
    """`sends` timed interleaved, then watched by a `GilMonitor` in calls of their own.

    The monitor's threads wake about 15,000 times a second, which on a
    small machine slows what they watch; so the times come from calls without
    it. Each send is watched in as many calls as it was timed in, `GIL_CALLS`
    at most, interleaved, with the garbage collector on as in sglang's process
    (the timed calls have it off, `bench.harness`).

    Per send: its timing figures, `after` (the median and count of its timed
    samples by the send that ran right before each, `Timing.medians_after`) and
    `gil_figures`, with `keep_rounds` also `rounds`, its timed samples as (round,
    seconds) pairs (`harness.paired_ratio`); with both sglang's and the hooked
    send, also `speedup` (sglang's median over the hooked one's).
    """
    timings = measure_interleaved({name: Stage(send) for name, send in sends.items()}, policy)
    calls = {name: min(timing.repeats, GIL_CALLS) for name, timing in timings.items()}
    windows: dict[str, list[GilWindow]] = {name: [] for name in sends}
    with GilMonitor() as monitor:
        for round_index in range(max(calls.values())):
            for name, send in sends.items():
                if round_index < calls[name]:
                    windows[name].append(monitor.window(send))
        realtime = monitor.realtime
    figures: dict[str, Any] = {
        name: {
            **timings[name].as_dict(),
            "after": timings[name].medians_after(),
            **gil_figures(windows[name], realtime),
        }
        for name in sends
    }
    if keep_rounds:
        for name in sends:
            figures[name]["rounds"] = [list(sample) for sample in timings[name].rounds]
    if set(sends) == set(VARIANTS):
        figures["speedup"] = timings["sglang"].median / timings["hooked"].median
    return figures


def gil_figures(windows: list[GilWindow], realtime: bool) -> dict[str, Any]:
    """Per call's longest GIL hold (wall clock, and the holder's running time) and longest
    GIL wait: median over calls and maximum.

    `gil_hold_holder` names the thread of the longest hold over all calls;
    `gil_sample_gap` is the sampler's longest gap between samples over all
    calls (holds are exact to about two gaps); `gil_realtime` whether the
    monitor's threads ran with real-time scheduling.
    """

    def over_calls(values: list[float]) -> dict[str, float]:
        return {"median": float(np.median(values)), "max": float(max(values)), "calls": len(values)}

    return {
        "gil_hold": over_calls([window.hold for window in windows]),
        "gil_hold_holder": max(windows, key=lambda window: window.hold).holder,
        "gil_hold_running": over_calls([window.running for window in windows]),
        "gil_wait": over_calls([window.wait for window in windows]),
        "gil_sample_gap": max(window.sample_gap for window in windows),
        "gil_realtime": realtime,
    }

"""The planners the benchmark compares, behind one small interface.

Each planner is prepared with a case's `BenchInput` (untimed: moving pages to the
device, building the layout), then timed on `plan()` (descriptors in the planner's
own form) and `hand_off()` (the per-call Python lists Mooncake's
`batch_transfer_sync_write` takes).
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

import gpu_planner as gp
from bench.harness import Stage, cuda_event_timer, cuda_wall_timer
from bench.inputs import BenchInput
from gpu_planner.profiling import nvtx_range

Batch = tuple[list[int], list[int], list[int]]
NVTX_DOMAIN = "gpu_planner_bench"


def bench_range(name: str) -> AbstractContextManager:
    """An NVTX range in the benchmark's domain, shown by `nsys profile -t nvtx`."""
    return nvtx_range(name, domain=NVTX_DOMAIN)


class Planner:
    """Base: a named planner; `plan_is_hand_off` when it produces the lists directly."""

    name = "planner"
    plan_is_hand_off = False

    def prepare(self, bench_input: BenchInput) -> None:
        raise NotImplementedError

    def plan(self) -> Any:
        raise NotImplementedError

    def hand_off(self) -> list[Batch]:
        raise NotImplementedError

    def stages(self) -> dict[str, Stage]:
        """The timed figures: hand-off, and plan when it differs from hand-off."""
        stages = {"hand_off": Stage(self.hand_off)}
        if not self.plan_is_hand_off:
            stages["plan"] = Stage(self.plan)
        return stages

    def extra_figures(self) -> dict[str, Any]:
        """Untimed per-case facts (the CUDA sync check); none by default."""
        return {}


class SglangPlanner(Planner):
    """sglang's own send path: the real `MooncakeKVManager._send_kvcache_generic`.

    The manager is `integration.sglang.testing.make_manager`'s (the real class
    with only the state the send reads); its engine records the lists instead
    of sending them. Grouping is sglang's `group_concurrent_contiguous`.
    """

    name = "sglang"
    plan_is_hand_off = True

    def __init__(self) -> None:
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        from bench.sglang_manager import RecordingEngine, make_manager

        # sglang's own function even where gpu_planner's plugin has hooked it.
        self._send_kvcache_generic = inspect.unwrap(MooncakeKVManager._send_kvcache_generic)
        self._manager = make_manager(None, mla=True)
        self._new_engine = RecordingEngine
        self._input: BenchInput | None = None

    def prepare(self, bench_input: BenchInput) -> None:
        self._input = bench_input
        self._manager.max_transfer_batch_indices = bench_input.case.batch_pages
        self._device_ptrs = {
            ptr
            for ptr, is_device in zip(bench_input.dst_ptrs, bench_input.dst_is_device, strict=True)
            if is_device
        }

    def plan(self) -> list[Batch]:
        return self.hand_off()

    def hand_off(self) -> list[Batch]:
        bench_input = self._input
        engine = self._new_engine()
        self._manager.engine = engine
        with bench_range("sglang/_send_kvcache_generic"):
            status = self._send_kvcache_generic(
                self._manager,
                "bench",
                bench_input.src_ptrs,
                bench_input.dst_ptrs,
                bench_input.item_lens,
                bench_input.src_pages,
                bench_input.dst_pages,
                executor=None,
                force_flat=True,
                dst_device_data_indices=bench_input.dst_device_pages,
                dst_device_data_ptrs=self._device_ptrs or None,
            )
        if status != 0:
            raise RuntimeError(f"sglang's _send_kvcache_generic returned {status}")
        return [(srcs, dsts, lens) for _, srcs, dsts, lens in engine.calls]


class ReferenceLoopPlanner(Planner):
    """gpu_planner's independent sglang-style pure-Python loop (used when sglang is absent)."""

    name = "reference"
    plan_is_hand_off = True

    def prepare(self, bench_input: BenchInput) -> None:
        self._input = bench_input

    def plan(self) -> list[Batch]:
        return self.hand_off()

    def hand_off(self) -> list[Batch]:
        bench_input = self._input
        with bench_range("reference/plan_batches"):
            return gp.reference.plan_batches(
                bench_input.src_pages,
                bench_input.dst_pages,
                bench_input.src_ptrs,
                bench_input.dst_ptrs,
                bench_input.item_lens,
                dst_is_device=bench_input.dst_is_device,
                dst_device_pages=bench_input.dst_device_pages,
                max_batch_pages=bench_input.case.batch_pages,
            )


class GpuPlannerBackend(Planner):
    """gpu_planner's `plan_transfer` on one backend, with the pages on `device`."""

    def __init__(self, backend: str, device: str) -> None:
        self.backend = backend
        self.device = torch.device(device)
        self.name = f"gpu_planner-{backend}"

    def _pages(self, pages: np.ndarray | None) -> np.ndarray | torch.Tensor | None:
        """The case's pages as this planner takes them.

        On the host: the very NumPy arrays sglang gets (its send path holds page
        lists as NumPy); on a device: a copy there, made before timing.
        """
        if pages is None or self.device.type == "cpu":
            return pages
        return torch.from_numpy(pages).to(self.device)

    def prepare(self, bench_input: BenchInput) -> None:
        self._src = self._pages(bench_input.src_pages)
        self._dst_pages = self._pages(bench_input.dst_pages)
        self._dst_device_pages = self._pages(bench_input.dst_device_pages)
        self._max_batch_pages = bench_input.case.batch_pages
        self._layout = gp.BufferLayout(
            bench_input.src_ptrs,
            bench_input.dst_ptrs,
            bench_input.item_lens,
            dst_is_device=bench_input.dst_is_device,
        )

    def plan_transfer(self) -> gp.TransferPlan:
        """The planner's launches only: no descriptor count is read back yet."""
        with bench_range(f"{self.name}/plan_transfer"):
            return gp.plan_transfer(
                self._src,
                self._dst_pages,
                self._layout,
                dst_device_pages=self._dst_device_pages,
                max_batch_pages=self._max_batch_pages,
                backend=self.backend,
            )

    def plan(self) -> gp.TransferPlan:
        plan = self.plan_transfer()
        with bench_range(f"{self.name}/materialise"):
            plan.num_descriptors  # noqa: B018  (forces the count read-back and the final copy)
        return plan

    def hand_off(self) -> list[Batch]:
        plan = self.plan()
        with bench_range(f"{self.name}/batches"):
            return [piece[2:] for piece in plan.pieces(lists=True)]


class CudaGpuPlannerBackend(GpuPlannerBackend):
    """Triton on CUDA: wall times with a drained stream, plus GPU time and the sync check."""

    def stages(self) -> dict[str, Stage]:
        return {
            "hand_off": Stage(self.hand_off, cuda_wall_timer),
            "plan": Stage(self.plan, cuda_wall_timer),
            "gpu_plan_transfer": Stage(self.plan_transfer, cuda_event_timer),
        }

    def no_host_sync_error(self) -> str | None:
        """Run `plan_transfer` with CUDA sync debugging set to error; the error text, if any."""
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            plan = self.plan_transfer()
        except RuntimeError as error:
            return str(error)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        plan.num_descriptors  # noqa: B018  (the final copy may sync; it is outside error mode)
        return None

    def extra_figures(self) -> dict[str, Any]:
        sync_error = self.no_host_sync_error()
        return {"no_host_sync": sync_error is None, "sync_error": sync_error}


class ListFloor:
    """The floor: the same per-call lists from ready contiguous int64 arrays (`tolist` per call)."""

    name = "floor"

    def __init__(self, plan: gp.TransferPlan) -> None:
        self._src = np.ascontiguousarray(plan.src_addrs.numpy())
        self._dst = np.ascontiguousarray(plan.dst_addrs.numpy())
        self._lens = np.ascontiguousarray(plan.lengths.numpy())
        offsets = plan.batch_offsets.tolist()
        self._bounds = [(a, b) for a, b in zip(offsets[:-1], offsets[1:], strict=True) if b > a]

    def stages(self) -> dict[str, Stage]:
        return {"hand_off": Stage(self.hand_off)}

    def hand_off(self) -> list[Batch]:
        with bench_range("floor/tolist"):
            return [
                (self._src[a:b].tolist(), self._dst[a:b].tolist(), self._lens[a:b].tolist())
                for a, b in self._bounds
            ]


def sglang_available() -> bool:
    """Whether sglang's Mooncake connector imports here."""
    try:
        import sglang.srt.disaggregation.mooncake.conn  # noqa: F401
    except Exception:  # sglang absent, or its import chain fails on this machine
        return False
    return True


def make_planners(reference: str, with_cuda: bool) -> list[Planner]:
    """The reference first (`sglang`, `loop`, or `auto`), then the gpu_planner backends."""
    if reference == "auto":
        reference = "sglang" if sglang_available() else "loop"
    planners: list[Planner] = [SglangPlanner() if reference == "sglang" else ReferenceLoopPlanner()]
    planners.append(GpuPlannerBackend("cpu", "cpu"))
    if with_cuda:
        planners.append(CudaGpuPlannerBackend("triton", "cuda"))
    return planners

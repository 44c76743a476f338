"""AROUND hook for sglang's `kv_to_page_indices` (`sglang.srt.mem_cache.common`).

sglang computes `(kv[::page_size] // page_size).cpu().numpy()`: a strided
slice, a division kernel and a pageable device-to-host copy. For CUDA tensors
the hook converts with gpu_planner's kernel and copies the pages once through
gpu_planner's pinned staging; the result is the same NumPy array (it keeps its
pinned block until it is freed). A HiSparse decode's two page spaces of one
request come from one launch (`decode_pages`). Anything else runs the original.

Whether the hook's conversion beats sglang's on a given GPU is measured, not
assumed: once per process, after sglang built its KV manager on a CUDA device,
`choose_page_path` times both on a few representative inputs (`PagePath`), and
the hook hands a call to sglang's code where sglang's was measured faster
(counted under `SGLANG_FASTER`, logged once with the figures).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

import gpu_planner as gp
from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.integration.sglang.decode_pages import kept_pages
from gpu_planner.integration.sglang.fallback import Fallback
from gpu_planner.pinned_copies import copy_to_host

logger = logging.getLogger("gpu_planner.integration.sglang.plugin")

SGLANG_FASTER = "pages: sglang's .cpu() path measured faster"  # the fallback key
# (tokens, page size) of the inputs timed: a short and a long prompt at page 1, a long one at 64.
REPRESENTATIVE_INPUTS = ((1024, 1), (16384, 1), (131072, 1), (131072, 64))
TIMED_CALLS = 21  # per path and input, after `WARM_CALLS` untimed ones; the median is kept
WARM_CALLS = 3


@dataclasses.dataclass
class PagesCall:
    """The arguments of `kv_to_page_indices` (sglang 0.5.23), bound like the original."""

    kv_indices: torch.Tensor
    page_size: int


@dataclasses.dataclass(frozen=True)
class PageTiming:
    """Median seconds of one representative call, through the hook and through sglang."""

    num_pages: int
    hook_s: float
    sglang_s: float

    def __str__(self) -> str:
        winner = "sglang" if self.sglang_faster else "hook"
        return (
            f"{self.num_pages} pages: hook {self.hook_s * 1e6:.1f} us, "
            f"sglang {self.sglang_s * 1e6:.1f} us -> {winner}"
        )

    @property
    def sglang_faster(self) -> bool:
        return self.sglang_s < self.hook_s


class PagePath:
    """Which code converts a CUDA page list of a given length: the measurement nearest to it
    (in pages, on a log scale) says; with no measurement, the hook's."""

    def __init__(self) -> None:
        self._timings: tuple[PageTiming, ...] = ()
        self._lock = threading.Lock()

    def choose(self, timings: Sequence[PageTiming]) -> None:
        """Decide by `timings` from now on, and log the figures and the choice."""
        with self._lock:
            self._timings = tuple(sorted(timings, key=lambda timing: timing.num_pages))
        logger.info(
            "gpu_planner: page hook vs sglang's .cpu() path (medians): %s",
            "; ".join(map(str, self._timings)) or "not measured, the hook converts",
        )

    def sglang_faster(self, num_pages: int) -> PageTiming | None:
        """The measurement that hands a list of `num_pages` pages to sglang, or None."""
        timings = self._timings
        if not timings:
            return None
        scale = math.log2(max(num_pages, 1))
        nearest = min(timings, key=lambda t: abs(math.log2(max(t.num_pages, 1)) - scale))
        return nearest if nearest.sglang_faster else None


PAGE_PATH = PagePath()  # this process's choice


def kv_to_page_indices_hook(*args, **kwargs) -> np.ndarray:
    """sglang's page indices of `kv_indices`, converted on the GPU for CUDA tensors."""
    call = PagesCall(*args, **kwargs)
    kv_indices = call.kv_indices
    if not (
        isinstance(kv_indices, torch.Tensor) and cuda_runtime().runs_on_device(kv_indices.device)
    ):
        raise Fallback("kv_to_page_indices of indices not on a CUDA device", key="pages on host")
    kept = kept_pages(kv_indices, call.page_size)
    if kept is not None:
        return kept
    if isinstance(call.page_size, int) and call.page_size > 0:
        timing = PAGE_PATH.sglang_faster(-(-kv_indices.numel() // call.page_size))
        if timing is not None:
            raise Fallback(f"{SGLANG_FASTER} on this GPU ({timing})", key=SGLANG_FASTER)
    return convert_on_device(kv_indices, call.page_size)


def convert_on_device(kv_indices: torch.Tensor, page_size: int) -> np.ndarray:
    """The hook's own conversion: one kernel, one pinned copy, one wait on its event (Triton:
    the indices are on a device, or on the host standing for one under the CUDA stand-in)."""
    try:
        pages = gp.kv_to_page_indices(kv_indices, page_size, "triton")
    except gp.PlanValidationError as error:
        raise Fallback(f"kv_to_page_indices input not supported ({error})", key="pages") from None
    return copy_to_host(pages).numpy()


def measure_page_paths(
    torch_device: torch.device,
    sglang_pages: Callable[[torch.Tensor, int], np.ndarray],
    inputs: Sequence[tuple[int, int]] = REPRESENTATIVE_INPUTS,
    timed_calls: int = TIMED_CALLS,
) -> list[PageTiming]:
    """Median host time of the hook's conversion and of `sglang_pages`, per (tokens, page size).

    Each input is an int32 `req_to_token`-like row on `torch_device`; the two
    paths alternate, each call starts after the device is idle and ends with its
    pages in host memory (both wait for their copy), so both are timed alike.
    """
    runtime = cuda_runtime()
    generator = torch.Generator().manual_seed(0)
    timings = []
    for tokens, page_size in inputs:
        row = torch.randint(0, 1 << 24, (tokens,), generator=generator, dtype=torch.int32)
        row = row.to(torch_device)
        paths = (convert_on_device, sglang_pages)
        samples: tuple[list[float], list[float]] = ([], [])
        for call in range(WARM_CALLS + timed_calls):
            for path, times in zip(paths, samples, strict=True):
                runtime.current_stream().synchronize()
                started = time.perf_counter()
                path(row, page_size)
                if call >= WARM_CALLS:
                    times.append(time.perf_counter() - started)
        hook_s, sglang_s = (statistics.median(times) for times in samples)
        timings.append(PageTiming(-(-tokens // page_size), hook_s, sglang_s))
    return timings


def choose_page_path() -> None:
    """Time the hook against sglang's own `kv_to_page_indices` on this process's GPU (which
    sglang selected by now) and decide by it (`PAGE_PATH`). A process that never initialised
    CUDA converts no page list on a device and is left alone."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    from sglang.srt.mem_cache import common

    sglang_pages = inspect.unwrap(common.kv_to_page_indices)
    torch_device = torch.device("cuda", torch.cuda.current_device())
    PAGE_PATH.choose(measure_page_paths(torch_device, sglang_pages))

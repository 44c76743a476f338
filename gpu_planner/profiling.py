"""NVTX ranges, so `nsys profile -t cuda,nvtx` shows each planner stage by name."""

from __future__ import annotations

import functools

import nvtx

DOMAIN = "gpu_planner"


@functools.cache
def nvtx_range(name: str, domain: str = DOMAIN) -> nvtx.annotate:
    """A named NVTX range (a cheap no-op unless a profiler is attached).

    One `annotate` per name, built once: entering it only pushes the range, so
    the planner's hot path does not rebuild NVTX event attributes per call.
    """
    return nvtx.annotate(name, domain=domain)

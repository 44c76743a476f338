"""NVTX ranges, so `nsys profile -t cuda,nvtx` shows each planner stage by name."""

from __future__ import annotations

import nvtx

DOMAIN = "gpu_planner"


def nvtx_range(name: str, domain: str = DOMAIN) -> nvtx.annotate:
    """A named NVTX range (a cheap no-op unless a profiler is attached)."""
    return nvtx.annotate(name, domain=domain)

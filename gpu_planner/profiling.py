"""NVTX ranges, so `nsys profile -t cuda,nvtx` shows each planner stage by name.

The `nvtx` package (the `nvtx` extra) gives named ranges in a domain. A full
sglang install does not have it, so without it the ranges come from
`torch.cuda.nvtx` (no domains: the name carries it), or do nothing where torch
has no NVTX; the choice is logged once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager

logger = logging.getLogger(__name__)

DOMAIN = "gpu_planner"

RangeFactory = Callable[[str, str], AbstractContextManager]


class _TorchRange(contextlib.ContextDecorator):
    """A reusable `torch.cuda.nvtx` range: push on enter, pop on exit."""

    def __init__(self, name: str, push: Callable[[str], object], pop: Callable[[], object]):
        self.name, self._push, self._pop = name, push, pop

    def __enter__(self) -> _TorchRange:
        self._push(self.name)
        return self

    def __exit__(self, *exc_info) -> None:
        self._pop()


def _torch_factory() -> RangeFactory | None:
    """Ranges from `torch.cuda.nvtx`, or None where torch was built without NVTX."""
    try:
        from torch.cuda import nvtx

        nvtx.range_push(f"{DOMAIN}/probe")
        nvtx.range_pop()
    except (ImportError, RuntimeError, AttributeError):
        return None
    return lambda name, domain: _TorchRange(f"{domain}/{name}", nvtx.range_push, nvtx.range_pop)


@functools.cache
def _range_factory() -> RangeFactory:
    """Where this process's ranges come from: chosen, and logged when not the nvtx package, once."""
    try:
        import nvtx
    except ImportError:
        torch_factory = _torch_factory()
        source = "torch.cuda.nvtx" if torch_factory else "nothing (no NVTX ranges)"
        logger.info("gpu_planner: the nvtx package is absent; NVTX ranges from %s", source)
        return torch_factory or (lambda name, domain: contextlib.nullcontext())
    return lambda name, domain: nvtx.annotate(name, domain=domain)


@functools.cache
def nvtx_range(name: str, domain: str = DOMAIN) -> AbstractContextManager:
    """A named NVTX range (a cheap no-op unless a profiler is attached).

    One range object per name, built once: entering it only pushes the range,
    so the planner's hot path does not rebuild NVTX event attributes per call.
    """
    return _range_factory()(name, domain)

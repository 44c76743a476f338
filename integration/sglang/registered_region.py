"""Memory registered with a manager's Mooncake engine, and the one lookup per manager.

Both the prefill's send slots (`send_slots`) and the decode's receive region
(`receive_staging`) are one allocation per `MooncakeKVManager`: made on the
device whose memory holds the KV buffers, registered through sglang's own
engine wrapper (`register`/`deregister`), deregistered when the manager is
dropped. `PerManager` makes each on first use and remembers why a manager
has none, so no later send tries again.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.cuda_streams import on_torch_device


class RegisteredRegion:
    """`nbytes` on `torch_device`, registered with `manager`'s engine wrapper until `release()`
    or the manager's end."""

    def __init__(self, manager: Any, nbytes: int, torch_device: torch.device) -> None:
        """Raises what the allocation or sglang's `register` raises."""
        self.torch_device = torch_device
        with on_torch_device(torch_device):
            self.region = cuda_runtime().empty_bytes(nbytes, torch_device)
        self._wrapper = manager.engine
        self._wrapper.register(self.region.data_ptr(), self.region.numel())
        self.release = weakref.finalize(manager, self._deregister)
        self.release.atexit = False  # at exit, an engine call of a daemon thread may still run

    def _deregister(self) -> None:
        self._wrapper.deregister(self.region.data_ptr())


def kernel_backend(torch_device: torch.device) -> str:
    """The gather's and scatter's backend for a region on `torch_device`: the Triton kernel for
    device memory (the region's device, which a CUDA stand-in lets host bytes stand for), the
    compiled CPU loop for host memory."""
    return "triton" if torch_device.type == "cuda" else "cpu"


Region = TypeVar("Region")


class PerManager(Generic[Region]):
    """One region per manager, made by `make` on first use; `make` returns why there is none
    as a string, remembered for the manager's life."""

    def __init__(self, make: Callable[[Any], Region | str]) -> None:
        self._make = make
        self.unavailable: str | None = None  # why no manager gets one now (not remembered)
        self._regions: weakref.WeakKeyDictionary[Any, Region | str] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self, manager: Any) -> Region | str:
        """`manager`'s region, made on first use, or why it has none."""
        if self.unavailable is not None:
            return self.unavailable
        region = self._regions.get(manager)  # a dict read: every call but the manager's first
        if region is None:
            with self._lock:
                region = self._regions.get(manager)
                if region is None:
                    region = self._regions[manager] = self._make(manager)
        return region

    def existing(self, manager: Any) -> Region | None:
        """`manager`'s region if one was made (never makes one); None for a manager that cannot
        be a weak key (sglang's unit tests build unhashable `SimpleNamespace` managers)."""
        try:
            region = self._regions.get(manager)
        except TypeError:
            return None
        return None if region is None or isinstance(region, str) else region

    def release(self, manager: Any) -> None:
        """Deregister and forget `manager`'s region (tests; a process keeps it while it serves)."""
        with self._lock:
            region = self._regions.pop(manager, None)
        if region is not None and not isinstance(region, str):
            region.release()

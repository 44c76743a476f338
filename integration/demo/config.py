"""The two-process demo's configuration: every knob, checked, with defaults sized like sglang's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gpu_planner.integration.demo.buffers import WORD_BYTES
from gpu_planner.integration.mooncake.transfer import checked_timeout

LOCALHOST = "127.0.0.1"  # both demo processes and their engines run on loopback
PLANNERS = ("gpu", "reference")
MODE_NAMES = ("push", "pull")


@dataclass(frozen=True)
class DemoConfig:
    """Every knob of the demo; the defaults move about 120 MiB in one request."""

    buffers: int = 61
    device_fraction: float = 0.5
    tokens: int = 32768
    page_size: int = 64
    item_len: int = 4096
    mean_run: float = 8.0
    max_batch_pages: int = 1024
    host_pool_factor: float = 2.0
    device_pool_factor: float = 1.5
    planner: str = "gpu"
    mode: str = "push"
    buffer_workers: int = 0
    seed: int = 0
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        checked_timeout("timeout_s", self.timeout_s, allow_zero=False)  # finite: no None
        if self.timeout_s is None:
            raise ValueError("timeout_s: the demo needs a finite bound, got None")
        for name in ("buffers", "page_size", "item_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("tokens", "max_batch_pages", "buffer_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.item_len % WORD_BYTES:
            raise ValueError(f"item_len: must be a multiple of {WORD_BYTES}, got {self.item_len}")
        if not 0.0 <= self.device_fraction <= 1.0:
            raise ValueError(f"device_fraction: must be in [0, 1], got {self.device_fraction}")
        for name in ("host_pool_factor", "device_pool_factor", "mean_run"):
            if getattr(self, name) < 1.0:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.planner not in PLANNERS:
            raise ValueError(f"planner: must be one of {PLANNERS}, got {self.planner!r}")
        if self.mode not in MODE_NAMES:
            raise ValueError(f"mode: must be one of {MODE_NAMES}, got {self.mode!r}")
        if self.buffer_workers and self.planner != "gpu":
            raise ValueError("buffer_workers: per-buffer submission needs planner 'gpu'")

    @property
    def num_pages(self) -> int:
        return math.ceil(self.tokens / self.page_size)

    def pool_pages(self, factor: float) -> int:
        """Pages of a pool holding `factor` times the request (at least one page)."""
        return max(1, math.ceil(self.num_pages * factor))

    @property
    def is_device(self) -> list[bool]:
        """Which buffers are device-backed: `device_fraction` of them, spread evenly."""
        fraction = self.device_fraction
        return [
            math.floor((b + 1) * fraction) > math.floor(b * fraction) for b in range(self.buffers)
        ]


def index_device() -> torch.device:
    """Where page indices live: the GPU when there is one (Triton path), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")

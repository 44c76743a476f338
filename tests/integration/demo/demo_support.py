"""The demo tests' small configuration: the demo's two processes, moving a few hundred KiB."""

from __future__ import annotations

import dataclasses

from gpu_planner.integration.demo.config import DemoConfig

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

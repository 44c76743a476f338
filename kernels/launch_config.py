"""Block sizes, warps and grid limits of every planner kernel, in one place.

The idea of Liger-Kernel's `ops/utils.py`: launchers take their tile size and
warp count from here, so a tuning change is one edit and `gp.warmup` compiles
exactly the configurations the launchers use.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

MAX_GRID_Y = 65535  # CUDA's limit on the second and third grid dimensions


@dataclass(frozen=True)
class LaunchConfig:
    """One kernel family's tile: `block` items per program, `num_warps` warps."""

    block: int
    num_warps: int

    def num_programs(self, items: int) -> int:
        """Programs needed to cover `items` (the grid's x dimension, up to 2**31 - 1)."""
        return triton.cdiv(items, self.block)

    def launch_options(self) -> dict[str, int]:
        """The `BLOCK` constexpr and launch options every launch of this family passes."""
        return {"BLOCK": self.block, "num_warps": self.num_warps}


PAGES = LaunchConfig(block=1024, num_warps=4)  # page conversion, run counts, run scatter
SCAN = LaunchConfig(block=1024, num_warps=4)  # block-count scan: one program per space
RUNS = LaunchConfig(block=1024, num_warps=4)  # descriptor expansion: runs per program
HEAD_SLICES = LaunchConfig(block=2048, num_warps=4)  # head-slice gather, scatter: lanes a tile

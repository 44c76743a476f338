"""The one place plan descriptors are handed to a Mooncake engine: arrays if it can, else lists.

Mooncake 0.3.14 added `batch_transfer_sync_{write,read}_arrays`, which take
buffer-protocol int64 arrays: the plan's host columns go in as contiguous row
views (one slice per batch), and no Python list of descriptors is built. Older
engines only take `list[int]`s, built by `plan.batches()` /
`plan.buffer_batches()`. The path is chosen once per engine class (a pybind
class either has the methods or not) and logged once;
`GPU_PLANNER_HANDOFF=lists` forces the list path.

Mooncake's read takes the local buffers first, then the peer's addresses; in a
plan those are the destinations and the sources, so a reader passes
`(dsts, srcs)`. Only Mooncake's Python API is called (its C++ request struct
changes size between releases).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import numpy as np

from gpu_planner.plan import BufferBatch, TransferPlan, exact_total

logger = logging.getLogger(__name__)

HANDOFF_ENV = "GPU_PLANNER_HANDOFF"
ARRAYS = "arrays"
LISTS = "lists"
Direction = Literal["write", "read"]
Path = Literal["arrays", "lists"]
Column = Sequence[int] | np.ndarray  # a list on the list path, an int64 view on the arrays path
EngineCall = Callable[[str, Column, Column, Column], int]


def lists_forced() -> bool:
    """True when GPU_PLANNER_HANDOFF=lists asks for the list path."""
    return os.environ.get(HANDOFF_ENV, "").strip().lower() == LISTS


@functools.cache
def _engine_has_arrays(engine_type: type, direction: Direction) -> bool:
    return hasattr(engine_type, f"batch_transfer_sync_{direction}_arrays")


@functools.cache
def _log_path_once(engine_type: type, direction: Direction, path: Path) -> None:
    """Log, once per engine class, direction and path, which hand-off it gets and why."""
    if path == ARRAYS:
        reason = "the engine has batch_transfer_sync_*_arrays"
    elif _engine_has_arrays(engine_type, direction):
        reason = f"{HANDOFF_ENV}=lists"
    else:
        reason = "the engine has no *_arrays methods (Mooncake < 0.3.14)"
    logger.info(
        "gpu_planner: Mooncake %s hand-off through %s (%s.%s: %s)",
        direction,
        path,
        engine_type.__module__,
        engine_type.__qualname__,
        reason,
    )


def handoff_path(engine: object, direction: Direction = "write") -> Path:
    """'arrays' when `engine` takes descriptor arrays and lists are not forced, else 'lists'."""
    return engine_type_path(type(engine), direction)


def engine_type_path(engine_type: type, direction: Direction = "write") -> Path:
    """`handoff_path` for every engine of class `engine_type`."""
    path: Path = ARRAYS if _engine_has_arrays(engine_type, direction) else LISTS
    if lists_forced():
        path = LISTS
    _log_path_once(engine_type, direction, path)
    return path


def engine_call(engine: object, direction: Direction, path: Path) -> EngineCall:
    """`engine`'s synchronous call for `direction` on `path`, in the plan's (src, dst, len) order.

    The returned function takes `(peer, srcs, dsts, lens)` and returns
    Mooncake's status; for reads it passes Mooncake the local destinations
    first.
    """
    suffix = "_arrays" if path == ARRAYS else ""
    method = getattr(engine, f"batch_transfer_sync_{direction}{suffix}")
    if direction == "write":
        return method

    def read(peer: str, srcs: Column, dsts: Column, lens: Column) -> int:
        return method(peer, dsts, srcs, lens)

    return read


def column_total(column: Column) -> int:
    """The exact sum of a list or array column (bytes, for a lengths column): a Python int."""
    return exact_total(column) if isinstance(column, np.ndarray) else sum(column)


def batches(plan: TransferPlan, path: Path) -> Iterator[tuple[Column, Column, Column]]:
    """`plan`'s (srcs, dsts, lens) per non-empty batch, in order, in `path`'s form."""
    return plan.batch_columns() if path == ARRAYS else plan.batches()


def buffer_batches(plan: TransferPlan, path: Path) -> Iterator[BufferBatch]:
    """`plan`'s per-buffer pieces in plan order, in `path`'s form."""
    return plan.buffer_batch_columns() if path == ARRAYS else plan.buffer_batches()

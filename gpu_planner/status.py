"""The status word: the one encoding of planner errors, shared by every backend.

The Triton kernels record errors with atomic-min into these slots instead of
reading anything back, and the CPU backend's compiled loops fill the same word;
the host reads it once and turns it into an exception. Slots:

- `NEGATIVE_PAGE_SLOTS[argument]`: the first position of a negative page in
  that page argument.
- `OUT_OF_BOUNDS`: `out_of_bounds_key` of the first descriptor that ends past its
  buffer (the registered length, or else the int64 address space), first by
  buffer, then run, then side (dst before src).

`NO_ERROR` (int64 max) marks an empty slot, so the minimum is the first error.
A core contract, so it imports nothing but NumPy: the kernels (the one core
module they import), the CPU backend and the plan all read it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

NO_ERROR = 2**63 - 1
NEGATIVE_PAGE_SLOTS = {"src_pages": 0, "dst_pages": 1, "dst_device_pages": 2}
OUT_OF_BOUNDS = 3
NUM_SLOTS = 4

DST_SIDE = 0  # ordered first: a wrong destination page space is the likelier mistake
SRC_SIDE = 1
SIDE_NAMES = ("dst", "src")


class OutOfBounds(NamedTuple):
    """A descriptor past its buffer: buffer in layout order, run in its space, side."""

    buffer: int
    run: int
    side: str  # "src" or "dst"


def out_of_bounds_key(buffer, run, capacity, side):
    """The `OUT_OF_BOUNDS` key of (buffer, run, side); `capacity` bounds the runs per space.

    Plain arithmetic so the CPU backend compiles this very function with Numba;
    the expansion kernel computes the same expression in int64.
    """
    return (buffer * capacity + run) * 2 + side


def recorded_out_of_bounds(status: np.ndarray, capacity: int) -> OutOfBounds | None:
    """The out-of-bounds descriptor recorded in `status` (host copy), or None."""
    key = int(status[OUT_OF_BOUNDS])
    if key == NO_ERROR:
        return None
    key, side = divmod(key, 2)
    buffer, run = divmod(key, capacity)
    return OutOfBounds(buffer, run, SIDE_NAMES[side])


def recorded_negative_page(status: np.ndarray) -> tuple[str, int] | None:
    """(argument, position) of the first negative page recorded in `status`, or None."""
    slots = status[:OUT_OF_BOUNDS].tolist()  # Python ints: one read of the host copy
    for argument, slot in NEGATIVE_PAGE_SLOTS.items():
        if slots[slot] != NO_ERROR:
            return argument, slots[slot]
    return None


def new_status_array() -> np.ndarray:
    """An empty status word in host memory (the CPU backend's)."""
    return _EMPTY_STATUS.copy()


_EMPTY_STATUS = np.full(NUM_SLOTS, NO_ERROR, dtype=np.int64)

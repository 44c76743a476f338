"""Numba compilation of the planner's CPU loops, one rule for every compiled module."""

from __future__ import annotations

from collections.abc import Callable

import numba


def compiled(function: Callable) -> Callable:
    """Numba-compile `function` without the GIL, cached on disk where Numba can write.

    `nogil` lets sender threads plan concurrently; the cache keeps the machine
    code across processes. With no writable cache location (a read-only
    install and no writable home) Numba refuses `cache=True` outright; compile
    on every start instead of failing.
    """
    try:
        return numba.njit(cache=True, nogil=True)(function)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(nogil=True)(function)

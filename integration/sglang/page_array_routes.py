"""Routes keyed by a request's parsed destination page array, found again from sglang's slices.

sglang's transfer worker hands the send hooks `dst_kv_indices[index_slice]`: a
view of the array its `TransferInfo` parser made. A prefill keeps two kinds of
route on such an array: a request's part of a decode's receive staging
(`prefill_routes`) and a request toward a decode of another page size, whose
array holds virtual pages (`page_sizes`). Each registers the array here and
finds its route, and the slice's first position in the array, from the view a
send gets. A route lives as long as its array (sglang's `TransferInfo`) does.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Generic, TypeVar

import numpy as np

RouteT = TypeVar("RouteT")


@dataclasses.dataclass(frozen=True, eq=False)
class _Entry(Generic[RouteT]):
    pages: weakref.ref  # the array (weak: the route ends with sglang's TransferInfo)
    address: int  # where its data starts: a slice's offset is from here
    route: RouteT


class RoutesByPages(Generic[RouteT]):
    """Routes by the page array they were registered with (its id, checked by identity)."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry[RouteT]] = {}
        self._lock = threading.Lock()

    def add(self, pages: np.ndarray, route: RouteT) -> None:
        """`pages` (an array holding its data: a slice of it finds it) belong to `route` while
        they live."""
        if isinstance(pages.base, np.ndarray):
            raise ValueError("pages that view another array: their slices could not find them")
        key, entry = id(pages), _Entry(weakref.ref(pages), pages.ctypes.data, route)
        with self._lock:
            self._entries[key] = entry
        weakref.finalize(pages, self._forget, key, entry)

    def _forget(self, key: int, entry: _Entry[RouteT]) -> None:
        with self._lock:
            if self._entries.get(key) is entry:
                del self._entries[key]

    def of(self, pages: Any) -> RouteT | None:
        """The route registered with exactly the array `pages`, or None."""
        entry = self._entries.get(id(pages))  # one dict read: atomic, no lock
        return entry.route if entry is not None and entry.pages() is pages else None

    def find(self, dst_pages: Any) -> tuple[RouteT, int] | None:
        """The route whose array `dst_pages` is a contiguous slice of (or is), and the slice's
        first position in it; None for any other page list."""
        if not self._entries or not isinstance(dst_pages, np.ndarray):
            return None
        base = dst_pages.base if isinstance(dst_pages.base, np.ndarray) else dst_pages
        entry = self._entries.get(id(base))
        if entry is None or entry.pages() is not base or dst_pages.dtype != base.dtype:
            return None
        offset = dst_pages.ctypes.data - entry.address
        if dst_pages.strides != (base.itemsize,) or offset % base.itemsize:
            return None
        return entry.route, offset // base.itemsize

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

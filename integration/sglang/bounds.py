"""Refuse a send that would read or write outside a registered buffer, before any byte moves.

sglang computes every descriptor's source address and length from values a
decode peer sends (its registered item length, its page lists) and never
checks them against the prefill's own buffers; Mooncake does not check local
addresses at all, so a hostile or broken registration makes the prefill read
past its buffers and send those bytes to the peer. The hooks call these
checks first, on whole columns (NumPy, per buffer, not per descriptor):

- every page index is >= 0 (`check_pages`), on both sides: a negative page
  lands before its buffer, possibly in another registered one;
- each token's head slice lies inside its token slot (`check_head_slices`),
  on both sides: the decode's item length sets the slice offset and length;
- every source buffer's last read (in its largest page) ends inside the
  prefill's registered memory (`check_sources`): in the region registered
  (`kv_args.kv_data_lens`, `kv_args.state_data_lens`) that holds the buffer's
  base.

The decode's own buffer lengths are not in sglang's registration (pointers and
item lengths only), so a destination is bounded by its page index (>= 0) and
its slot; Mooncake itself refuses remote ranges outside the peer's registered
memory. A violation raises `OutOfRange`; the hook turns it into sglang's
failed-send status with `refuse`. The generic send's planner finds the same
faults in the scan it makes anyway (its layout's source lengths are the room a
registration leaves each buffer, `registered_room_of`); these checks then only
say which (`send._plan`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpu_planner import settings
from gpu_planner.inputs import INT64_MAX
from gpu_planner.integration.sglang.fallback import log_once

# The prefill's registered buffers as `registration` gives them: (pointers, lengths).
Registration = tuple[tuple[int, ...], tuple[int, ...]]


class OutOfRange(ValueError):
    """A send would read or write outside a registered buffer; names the buffer and field."""


def refuse(peer: str, error: OutOfRange) -> int:
    """sglang's failed-send status (-1), logged at ERROR the first time `peer` is refused.

    The caller (sglang's transfer worker) concludes the request as failed and
    marks the session failed, as for any failed send.
    """
    log_once(
        logging.ERROR,
        f"gpu_planner: refused a send to peer {peer} before any byte moved (logged once per "
        f"peer): {error}",
        f"refused peer {peer}",
    )
    return -1


def check_pages(pages: np.ndarray, field: str) -> int:
    """The largest page of a 1-D integer array (-1 when empty); `OutOfRange` for a negative one."""
    if not pages.size:
        return -1
    if pages.size <= SMALL_PAGES and pages.dtype.kind in "iu":
        values = pages.tolist()
        smallest, largest = min(values), max(values)
    else:
        smallest, largest = int(_smallest(pages)), None
    if smallest < 0:
        _raise_negative(pages, field)
    return int(_largest(pages)) if largest is None else largest


def check_no_negative(pages: np.ndarray, field: str) -> None:
    """`OutOfRange` for a negative page of a 1-D integer array (`check_pages` without the max)."""
    if not pages.size:
        return
    if pages.size <= SMALL_PAGES and pages.dtype.kind in "iu":
        smallest = min(pages.tolist())
    else:
        smallest = int(_smallest(pages))
    if smallest < 0:
        _raise_negative(pages, field)


SMALL_PAGES = 64  # up to this many pages, min and max of a list beat NumPy's reductions
_smallest, _largest = np.minimum.reduce, np.maximum.reduce  # as ndarray.min/max, one call less


def _raise_negative(pages: np.ndarray, field: str) -> None:
    position = int(np.flatnonzero(pages < 0)[0])
    raise OutOfRange(f"{field}[{position}] = {int(pages[position])}: a page index below 0")


def check_head_slices(
    side: str,
    offsets: np.ndarray | int,
    slice_lens: np.ndarray | int,
    token_lens: np.ndarray | int,
    field: str,
) -> None:
    """Each buffer's head slice `[offset, offset + slice_len)` lies in its `token_len`-byte slot.

    Python ints (any size) or int64 arrays of values in [0, 2**63): no sum is
    formed, so nothing overflows. `field` names the value that set the slice.
    """
    fits = np.atleast_1d(
        np.asarray(offsets >= 0)
        & np.asarray(slice_lens >= 0)
        & np.asarray(offsets <= token_lens)
        & np.asarray(slice_lens <= token_lens - offsets)
    )
    if fits.all():
        return
    bad = int(np.flatnonzero(~fits)[0])
    offset, slice_len, token_len = (
        np.broadcast_to(np.asarray(value, dtype=object), fits.shape)[bad]
        for value in (offsets, slice_lens, token_lens)
    )
    raise OutOfRange(
        f"{side} buffer {bad}: {field} gives a head slice of {slice_len} bytes at offset "
        f"{offset} of a {token_len}-byte token slot"
    )


def check_sources(
    kv_args: Any,
    ptrs: Sequence[int],
    max_page: int,
    page_lens: Sequence[int] | np.ndarray | int,
    last_offsets: Sequence[int] | np.ndarray | int,
    read_lens: Sequence[int] | np.ndarray | int,
    field: str,
) -> None:
    """What each source buffer reads of pages 0..`max_page` lies in the prefill's registered memory.

    Buffer `b`'s last read starts `last_offsets[b]` bytes into page `max_page`
    (pages of `page_lens[b]` bytes) and is `read_lens[b]` long; it must end in
    one region registered in `kv_args` (KV and state buffers) that holds
    `ptrs[b]`. Values are in [0, 2**63); the check is exact for any of them
    (no sum or product leaves int64: what falls short is clamped to -1 first).
    """
    if max_page < 0 or not len(ptrs):
        return
    registered = registration(kv_args)
    try:  # tuples and ints: the limit is kept per layout and registration
        limit = _kept_limit(registered, ptrs, page_lens, last_offsets, read_lens)
    except TypeError:  # arrays (not hashable): computed for this call
        limit = int(_source_limits(registered, ptrs, page_lens, last_offsets, read_lens)[2].min())
    if max_page <= limit:
        return
    ptr_array, room, limits = _source_limits(registered, ptrs, page_lens, last_offsets, read_lens)
    fits = max_page <= limits
    page_lens, last_offsets, read_lens = (
        np.asarray(values, dtype=np.int64) for values in (page_lens, last_offsets, read_lens)
    )
    bad = int(np.flatnonzero(~fits)[0])
    page_len, last_offset, read_len = (
        int(np.broadcast_to(values, ptr_array.shape)[bad])
        for values in (page_lens, last_offsets, read_lens)
    )
    end = max_page * page_len + last_offset + read_len
    where = (
        f"{int(room[bad])} registered bytes from it"
        if room[bad] > 0
        else "no registered buffer holds it"
    )
    raise OutOfRange(
        f"source buffer {bad} at {hex(int(ptr_array[bad]))}: page {max_page} of {field} at "
        f"{page_len} bytes per page reads up to byte {end}, but {where} "
        "(kv_args.kv_data_lens / state_data_lens)"
    )


@settings.sized_cache(settings.LAYOUT_CACHE_SIZE)
def _kept_limit(
    registered: Registration,
    ptrs: Sequence[int],
    page_lens: Sequence[int] | int,
    last_offsets: Sequence[int] | int,
    read_lens: Sequence[int] | int,
) -> int:
    """The largest `max_page` every buffer fits (`_source_limits`), kept for hashable values."""
    return int(_source_limits(registered, ptrs, page_lens, last_offsets, read_lens)[2].min())


def _source_limits(
    registered: Registration,
    ptrs: Sequence[int],
    page_lens: Sequence[int] | np.ndarray | int,
    last_offsets: Sequence[int] | np.ndarray | int,
    read_lens: Sequence[int] | np.ndarray | int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ptrs, registered room, largest `max_page` that fits) per buffer, as int64 arrays.

    Buffer `b` fits `max_page >= 0` exactly when `max_page <= limits[b]`:
    `INT64_MAX` where it reads nothing, -1 where not even page 0 fits.
    """
    ptr_array = np.asarray(ptrs, dtype=np.int64)
    page_lens, last_offsets, read_lens = (
        np.asarray(values, dtype=np.int64) for values in (page_lens, last_offsets, read_lens)
    )
    room = _room(_regions(*registered), ptr_array)
    # Room left for max_page * page_len; < 0 exactly where the last read does not fit.
    room_after_last = np.maximum(np.maximum(room, -1) - last_offsets, -1) - read_lens
    whole_pages = np.where(page_lens > 0, room_after_last // np.maximum(page_lens, 1), INT64_MAX)
    limits = np.where(read_lens == 0, INT64_MAX, np.where(room_after_last >= 0, whole_pages, -1))
    return ptr_array, room, np.broadcast_to(limits, ptr_array.shape)


def registered_room(kv_args: Any, ptrs: np.ndarray) -> np.ndarray:
    """Bytes from each pointer (int64) to the end of a registered region holding it; <= 0: none."""
    return registered_room_of(registration(kv_args), ptrs)


def registered_room_of(registered: Registration, ptrs: np.ndarray) -> np.ndarray:
    """`registered_room` of a `registration(kv_args)` (its pointers and lengths)."""
    return _room(_regions(*registered), ptrs)


def _room(regions: tuple[np.ndarray, np.ndarray], ptrs: np.ndarray) -> np.ndarray:
    starts, reach = regions
    holder = np.searchsorted(starts, ptrs, side="right") - 1  # >= 0: the sentinel
    return reach[holder] - ptrs


def registration(kv_args: Any) -> Registration:
    """(pointers, lengths) of the buffers the prefill registered, paired as sglang pairs them.

    All that `registered_room` reads of `kv_args`: a key for what is built from it.
    """
    kv_ptrs = getattr(kv_args, "kv_data_ptrs", None) or ()
    kv_lens = getattr(kv_args, "kv_data_lens", None) or ()
    state_ptrs = getattr(kv_args, "state_data_ptrs", None)
    if not state_ptrs and len(kv_ptrs) == len(kv_lens):  # KV buffers only (as sends meet it)
        return tuple(kv_ptrs), tuple(kv_lens)
    lists = [(kv_ptrs, kv_lens)]
    lists += zip(
        getattr(kv_args, "state_data_ptrs", None) or [],
        getattr(kv_args, "state_data_lens", None) or [],
        strict=False,
    )
    ptrs: list[int] = []
    lens: list[int] = []
    for list_ptrs, list_lens in lists:
        # Each pointer list with its own length list, cut to the shorter, as sglang registers
        # them (`_registerable_regions`): a length never pairs with another list's pointer.
        list_ptrs, list_lens = list_ptrs or (), list_lens or ()
        count = min(len(list_ptrs), len(list_lens))
        ptrs += list_ptrs[:count]
        lens += list_lens[:count]
    return tuple(ptrs), tuple(lens)


@settings.sized_cache(settings.LAYOUT_CACHE_SIZE)
def _regions(ptrs: tuple[int, ...], lens: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(starts, reach) of the registered buffers, sorted by start; built once per registration.

    `reach[i]` is the furthest end of the regions starting at or before
    `starts[i]`: a range from `ptr` is inside one region when the reach of the
    last start <= `ptr` is at least its end.
    """
    regions = sorted(
        (int(ptr), min(int(ptr) + int(length), INT64_MAX))
        for ptr, length in zip(ptrs, lens, strict=True)  # paired by `registration`
        if length > 0 and 0 <= ptr <= INT64_MAX
    )
    # A sentinel region before every address (reach -1) holds nothing.
    starts = np.array([-1] + [start for start, _ in regions], dtype=np.int64)
    reach = np.maximum.accumulate(np.array([-1] + [end for _, end in regions], dtype=np.int64))
    return starts, reach

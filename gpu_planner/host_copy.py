"""Host byte copies for the CPU gather and scatter loops, joined where they continue each other.

A head-sliced gather or scatter copies one slice per token: at page size 16
and 64-byte tokens (MLA's 1 KiB pages) a 4 MB send is 62,464 `memcpy` calls
of 64 bytes, where a call's own cost rivals its bytes'.
Where a slice is the whole token on both sides, a page is one copy; where
consecutive copies continue each other on both sides (consecutive pages of a
run, whole pages into consecutive staged pages), they are joined into one.
The bytes written are the same: copies are only ever joined, never reordered,
and no copy reads what another writes (the callers check their regions apart).

The gather's and the scatter's loops live here too: Numba caches a compiled
function by its own file, and a loop cached in another file would keep the
copies compiled into it before an edit here.
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from gpu_planner.jit import compiled

__all__ = ["copy_page_slices", "finish_copies", "gather_loop", "scatter_loop"]


@intrinsic
def _copy_bytes(typingctx, dst_address, src_address, nbytes):
    """memcpy(dst_address, src_address, nbytes) on raw int64 addresses."""

    def codegen(context, builder, signature, args):
        dst, src = (builder.inttoptr(address, cgutils.voidptr_t) for address in args[:2])
        cgutils.raw_memcpy(builder, dst, src, args[2], 1)

    return types.void(types.int64, types.int64, types.int64), codegen


@compiled
def _copy_joined(pending, dst, src, nbytes):
    """Copy `nbytes` from `src` to `dst`: joined to `pending` (int64 [dst, src, nbytes], the
    copy not yet made; nbytes 0: none) where it continues it on both sides, else `pending`
    is copied now and this copy waits in its place."""
    end = pending[2]
    if end and dst == pending[0] + end and src == pending[1] + end:
        pending[2] = end + nbytes
        return
    if end:
        _copy_bytes(pending[0], pending[1], end)
    pending[0], pending[1], pending[2] = dst, src, nbytes


@compiled
def copy_page_slices(
    pending, dst_page, src_page, page_size, dst_token_len, src_token_len, slice_len
):
    """Copy each of a page's `page_size` token slices (one copy where they are whole tokens
    on both sides); `finish_copies(pending)` makes the last one."""
    if dst_token_len == slice_len and src_token_len == slice_len:
        _copy_joined(pending, dst_page, src_page, page_size * slice_len)
        return
    for slot in range(page_size):
        _copy_joined(
            pending, dst_page + slot * dst_token_len, src_page + slot * src_token_len, slice_len
        )


@compiled
def finish_copies(pending):
    """Make the copy still pending, if any."""
    if pending[2]:
        _copy_bytes(pending[0], pending[1], pending[2])
        pending[2] = 0


@compiled
def gather_loop(entries, pages, page_size):
    """The CPU gather (`head_gather`): each token's slice of source page `pages[i]` into staged
    page `i`; `entries` as the kernel's, with absolute staged bases."""
    pending = np.zeros(3, dtype=np.int64)
    for entry in range(entries.shape[0]):
        src_base, src_page_len, src_token_len = entries[entry, :3]
        dst_base, dst_page_len, dst_token_len, slice_len = entries[entry, 3:]
        for position in range(pages.shape[0]):
            copy_page_slices(
                pending,
                dst_base + position * dst_page_len,
                src_base + pages[position] * src_page_len,
                page_size, dst_token_len, src_token_len, slice_len,
            )  # fmt: skip
    finish_copies(pending)


@compiled
def scatter_loop(entries, pages, page_size):
    """The CPU scatter (`head_scatter`): staged page `i` into destination page `pages[space, i]`;
    `entries` as the kernel's, with absolute staged bases.

    `pages` [2, num_pages]: the host-space, then the device-space pages.
    """
    pending = np.zeros(3, dtype=np.int64)
    for entry in range(entries.shape[0]):
        src_base, src_page_len, src_token_len = entries[entry, :3]
        dst_base, dst_page_len, dst_token_len, slice_len, space = entries[entry, 3:]
        space_pages = pages[space]
        for position in range(pages.shape[1]):
            copy_page_slices(
                pending,
                dst_base + space_pages[position] * dst_page_len,
                src_base + position * src_page_len,
                page_size, dst_token_len, src_token_len, slice_len,
            )  # fmt: skip
    finish_copies(pending)

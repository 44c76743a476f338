"""KV buffers for the two-process demo: fragmented page allocators, a byte pattern, verification.

Every page of every buffer holds a pattern that encodes (side, buffer, page,
byte): 64-bit word `j` of page `p` of buffer `b` is `row[j] ^ tag(side, b, p)`,
where `tag` is a bijective 64-bit mix, so two distinct pages never hold the
same bytes. The decode side starts from its own pattern; after a transfer each
planned destination page must hold its source page's bytes exactly and every
other page its initial bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PREFILL_SIDE = 1
DECODE_SIDE = 2
WORD_BYTES = 8


def _mix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection on uint64 (NumPy array arithmetic wraps mod 2**64)."""
    values = values + np.uint64(0x9E3779B97F4A7C15)
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


def page_tags(side: int, buffer: int, pages: np.ndarray) -> np.ndarray:
    """One distinct uint64 tag per (side, buffer, page) for pages < 2**32 and buffers < 2**24."""
    key = (np.uint64(side) << np.uint64(56)) | (np.uint64(buffer) << np.uint64(32))
    return _mix64(key | pages.astype(np.uint64))


def word_row(item_len: int) -> np.ndarray:
    """The per-word part of the pattern: makes every byte position of a page differ."""
    return _mix64(np.arange(item_len // WORD_BYTES, dtype=np.uint64))


class KVBuffer:
    """One registered KV buffer: `pool_pages` pages of `item_len` bytes, filled with a pattern."""

    def __init__(self, side: int, index: int, pool_pages: int, item_len: int) -> None:
        if item_len % WORD_BYTES:
            raise ValueError(f"item_len: must be a multiple of {WORD_BYTES} bytes, got {item_len}")
        self.side = side
        self.index = index
        self.item_len = item_len
        self.data = np.empty(pool_pages * item_len, dtype=np.uint8)
        self.words[:] = self.expected_words(np.arange(pool_pages), side)

    @property
    def ptr(self) -> int:
        return self.data.ctypes.data

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def words(self) -> np.ndarray:
        """The buffer as [pool_pages, item_len / 8] uint64 words (a view)."""
        return self.data.view(np.uint64).reshape(-1, self.item_len // WORD_BYTES)

    def expected_words(self, pages: np.ndarray, side: int) -> np.ndarray:
        """Pattern words of `pages` of this buffer index as `side` fills them."""
        return word_row(self.item_len)[None, :] ^ page_tags(side, self.index, pages)[:, None]


@dataclass(frozen=True)
class Verification:
    """Outcome of checking a decode buffer set after a transfer."""

    pages_checked: int
    bad_pages: int
    changed_pages: int
    bytes_checked: int

    @property
    def ok(self) -> bool:
        return self.bad_pages == 0 and self.changed_pages == 0

    def __add__(self, other: Verification) -> Verification:
        return Verification(
            *(getattr(self, name) + getattr(other, name) for name in self.__dataclass_fields__)
        )


def verify_buffer(buffer: KVBuffer, dst_pages: np.ndarray, src_pages: np.ndarray) -> Verification:
    """Check every byte: `dst_pages` must hold the prefill's `src_pages`, all else be untouched.

    `bad_pages` counts planned destination pages that differ from their source
    page; `changed_pages` counts pages outside the plan that lost their initial
    bytes. Pass empty page arrays to check that nothing changed at all.
    """
    words = buffer.words
    pool_pages = words.shape[0]
    tags = page_tags(DECODE_SIDE, buffer.index, np.arange(pool_pages))
    tags[dst_pages] = page_tags(PREFILL_SIDE, buffer.index, src_pages)
    differs = (words != word_row(buffer.item_len)[None, :] ^ tags[:, None]).any(axis=1)
    planned = np.zeros(pool_pages, dtype=bool)
    planned[dst_pages] = True
    return Verification(
        pages_checked=pool_pages,
        bad_pages=int(np.count_nonzero(differs & planned)),
        changed_pages=int(np.count_nonzero(differs & ~planned)),
        bytes_checked=buffer.nbytes,
    )

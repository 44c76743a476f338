"""host_copy: joined copies write exactly the bytes of one copy per token slice."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_planner.host_copy import copy_page_slices, finish_copies


@st.composite
def page_copies(draw):
    """A page geometry and a list of (dst page, src page) pairs: runs, repeats and gaps."""
    page_size = draw(st.sampled_from([1, 2, 3, 16]))
    slice_len = draw(st.integers(0, 12))
    whole = draw(st.booleans())  # slices that are whole tokens on both sides: pages join
    src_token = slice_len + (0 if whole else draw(st.integers(0, 6)))
    dst_token = slice_len + (0 if whole else draw(st.integers(0, 6)))
    count = draw(st.integers(0, 12))
    src_pages = draw(st.lists(st.integers(0, 15), min_size=count, max_size=count))
    dst_pages = draw(st.sampled_from(["consecutive", "drawn"]))
    if dst_pages == "consecutive":
        dst_pages = list(range(count))
    else:  # distinct: each destination written once, as every caller's are
        dst_pages = draw(st.permutations(range(16)))[:count]
    return page_size, slice_len, src_token, dst_token, list(zip(dst_pages, src_pages, strict=True))


@settings(max_examples=300)
@given(page_copies())
def test_joined_copies_write_what_per_token_copies_write(case):
    page_size, slice_len, src_token, dst_token, pairs = case
    src = np.random.default_rng(0).integers(1, 256, 16 * page_size * src_token, dtype=np.uint8)
    joined = np.zeros(16 * page_size * dst_token, dtype=np.uint8)
    expected = joined.copy()
    pending = np.zeros(3, dtype=np.int64)
    for dst_page, src_page in pairs:
        copy_page_slices(
            pending,
            joined.ctypes.data + dst_page * page_size * dst_token,
            src.ctypes.data + src_page * page_size * src_token,
            page_size, dst_token, src_token, slice_len,
        )  # fmt: skip
        for slot in range(page_size):
            at_dst = (dst_page * page_size + slot) * dst_token
            at_src = (src_page * page_size + slot) * src_token
            expected[at_dst : at_dst + slice_len] = src[at_src : at_src + slice_len]
    finish_copies(pending)
    assert pending[2] == 0
    np.testing.assert_array_equal(joined, expected)


def test_a_run_of_whole_pages_is_one_copy_and_a_gap_starts_another():
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    pending = np.zeros(3, dtype=np.int64)
    for page in (1, 2, 3):  # pages of 4 tokens of 2 bytes, whole slices: one copy of 24 bytes
        copy_page_slices(pending, dst.ctypes.data + page * 8, src.ctypes.data + page * 8,
                         4, 2, 2, 2)  # fmt: skip
    assert pending.tolist() == [dst.ctypes.data + 8, src.ctypes.data + 8, 24]
    assert not dst.any()  # nothing copied while the run goes on
    copy_page_slices(pending, dst.ctypes.data + 48, src.ctypes.data + 40, 4, 2, 2, 2)
    assert pending.tolist() == [dst.ctypes.data + 48, src.ctypes.data + 40, 8]
    finish_copies(pending)
    assert dst[8:32].tolist() == list(range(8, 32))
    assert dst[48:56].tolist() == list(range(40, 48))
    assert not dst[:8].any() and not dst[32:48].any() and not dst[56:].any()


def test_half_token_slices_join_only_where_both_sides_continue():
    src = np.arange(32, dtype=np.uint8)
    dst = np.zeros(16, dtype=np.uint8)
    pending = np.zeros(3, dtype=np.int64)
    # 4 slots of 4-byte source tokens, the last 2 bytes of each, packed on the destination:
    # the destination continues, the source does not, so each slot is its own copy.
    copy_page_slices(pending, dst.ctypes.data, src.ctypes.data + 2, 4, 2, 4, 2)
    assert pending.tolist() == [dst.ctypes.data + 6, src.ctypes.data + 14, 2]
    finish_copies(pending)
    assert dst[:8].tolist() == [2, 3, 6, 7, 10, 11, 14, 15]

"""Different page sizes: unit pages and the planner equal the token-walk reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pages_strategies import PAGE_SHAPES, _pages_of_shape
from suite_support import list_batches
from test_plan import as_input

import gpu_planner as gp
from gpu_planner import reference
from gpu_planner.page_geometry import (
    PageGeometry,
    common_unit,
    unit_item_lens,
    unit_pages,
)

PAGE_SIZES = (1, 2, 3, 4, 8, 16, 32, 64)  # sglang's 1, 16, 32, 64, and sizes that do not divide
UNIT_BATCHES = (0, 1, 3, 64)
TOP = 2**47


@st.composite
def side(draw, num_tokens: int, name: str) -> tuple[PageGeometry, np.ndarray]:
    """One side's geometry (its first sent token aligned to a page or not) and its pages."""
    page_size = draw(st.sampled_from(PAGE_SIZES), label=f"{name} page size")
    first = draw(
        st.one_of(
            st.just(0),
            st.integers(0, 3).map(lambda pages: pages * page_size),  # a page-aligned prefix
            st.integers(0, 3 * page_size),  # a prefix ending inside a page
        ),
        label=f"{name} first token",
    )
    count = -(-(first + num_tokens) // page_size) + draw(st.integers(0, 2))
    shape = draw(st.sampled_from(PAGE_SHAPES[:3]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = draw(st.sampled_from([0, 5, 2**20]))
    pages = base + _pages_of_shape(shape, rng, count, draw(st.sampled_from([1.5, 4.0, 16.0])))
    return PageGeometry(page_size, first), pages


@st.composite
def repaged_sends(draw) -> dict:
    num_tokens = draw(st.one_of(st.just(0), st.just(1), st.integers(0, 400)))
    src, src_pages = draw(side(num_tokens, "src"))
    dst, dst_pages = draw(side(num_tokens, "dst"))
    num_buffers = draw(st.integers(0, 4))
    token_bytes = draw(st.lists(st.integers(1, 96), min_size=num_buffers, max_size=num_buffers))
    return {
        "num_tokens": num_tokens,
        "src": src,
        "dst": dst,
        "src_pages": src_pages,
        "dst_pages": dst_pages,
        "src_ptrs": [TOP - draw(st.integers(1, 2**12)) * 2**20 for _ in token_bytes],
        "dst_ptrs": [TOP + draw(st.integers(0, 2**12)) * 2**20 for _ in token_bytes],
        "src_item_lens": [b * src.page_size for b in token_bytes],
        "dst_item_lens": [b * dst.page_size for b in token_bytes],
        "unit_batch": draw(st.sampled_from(UNIT_BATCHES)),
    }


def expected(send: dict) -> list:
    unit = common_unit(send["src"], send["dst"])
    return reference.plan_repaged(
        send["num_tokens"],
        send["src_pages"].tolist(),
        send["src"].page_size,
        send["dst_pages"].tolist(),
        send["dst"].page_size,
        send["src_ptrs"],
        send["dst_ptrs"],
        send["src_item_lens"],
        send["src"].first_token,
        send["dst"].first_token,
        send["unit_batch"] * unit,
    )


def planned(send: dict, backend: str, device: torch.device, strided: bool):
    src, dst = send["src"], send["dst"]
    unit = common_unit(src, dst)
    lists = {}
    for name, geometry in (("src_pages", src), ("dst_pages", dst)):
        pages = as_input(send[name], device, torch.int64, strided)
        lists[name] = unit_pages(pages, geometry, unit, send["num_tokens"], name)
    item_lens = unit_item_lens(send["src_item_lens"], src, send["dst_item_lens"], dst, unit)
    layout = gp.BufferLayout(send["src_ptrs"], send["dst_ptrs"], item_lens)
    return gp.plan_transfer(
        lists["src_pages"],
        lists["dst_pages"],
        layout,
        max_batch_pages=send["unit_batch"],
        backend=backend,
    )


@settings(max_examples=200)
@given(send=repaged_sends(), strided=st.booleans())
def test_unit_pages_plan_the_joint_slot_runs(backend_device, send, strided):
    """Every backend, on every pair of page sizes and prefixes, sends what the token walk sends:
    one descriptor per joint contiguous slot run per buffer, batch cuts included."""
    backend, device = backend_device
    assert list_batches(planned(send, backend, device, strided)) == expected(send)


@given(send=repaged_sends())
def test_equal_page_sizes_plan_what_an_equal_page_send_plans(send):
    """With one page size and no prefix, the unit is the page: sglang's own semantics."""
    send["dst"] = PageGeometry(send["src"].page_size)
    send["src"] = PageGeometry(send["src"].page_size)
    send["dst_pages"] = send["src_pages"][::-1] + 3  # as many pages, other runs
    send["dst_item_lens"] = send["src_item_lens"]
    num_pages = -(-send["num_tokens"] // send["src"].page_size)
    assert list_batches(planned(send, "cpu", torch.device("cpu"), False)) == reference.plan_batches(
        send["src_pages"][:num_pages].tolist(),
        send["dst_pages"][:num_pages].tolist(),
        send["src_ptrs"],
        send["dst_ptrs"],
        send["src_item_lens"],
        max_batch_pages=send["unit_batch"],
    )


def test_a_coarse_prefill_to_a_fine_decode_gets_one_descriptor_per_joint_run():
    """Page 64 -> 16: four decode pages in a row under one prefill page are one descriptor; a
    decode page out of order splits it there, not per token."""
    src, dst = PageGeometry(64), PageGeometry(16)
    unit = common_unit(src, dst)
    assert unit == 16
    src_units = unit_pages(np.array([5, 9]), src, unit, 128, "src_pages")
    dst_units = unit_pages(np.array([40, 41, 42, 43, 7, 8, 50, 51]), dst, unit, 128, "dst_pages")
    layout = gp.BufferLayout([TOP], [TOP * 2], unit_item_lens([64 * 8], src, [16 * 8], dst, unit))
    plan = gp.plan_transfer(src_units, dst_units, layout)
    assert plan.descriptors.tolist() == [
        [TOP + 5 * 64 * 8, TOP * 2 + 40 * 16 * 8, 64 * 8],
        [TOP + 9 * 64 * 8, TOP * 2 + 7 * 16 * 8, 32 * 8],
        [TOP + 9 * 64 * 8 + 32 * 8, TOP * 2 + 50 * 16 * 8, 32 * 8],
    ]


def test_a_different_bytes_per_token_names_the_buffer_and_both_geometries():
    with pytest.raises(gp.PlanValidationError, match=r"buffer 1: .*page size 64.*page size 16"):
        unit_item_lens([64 * 4, 64 * 8], PageGeometry(64), [16 * 4, 16 * 4], PageGeometry(16), 16)


def test_too_few_pages_name_the_list_before_any_descriptor():
    with pytest.raises(gp.PlanValidationError, match="dst_pages: 1 pages of page size 16"):
        unit_pages(np.array([3]), PageGeometry(16, first_token=8), 8, 16, "dst_pages")


@pytest.mark.parametrize("page", [-1, 2**62])
def test_a_page_that_is_no_page_is_named(page):
    with pytest.raises(gp.PlanValidationError, match=rf"src_pages\[1\] = {page}"):
        unit_pages(np.array([0, page, 2]), PageGeometry(4), 1, 12, "src_pages")

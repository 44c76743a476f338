"""No wrapped address: every descriptor ends at or below 2**63 - 1 and inside its registered
length, or the plan is refused, on every backend and in the reference alike."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from suite_support import list_batches

import gpu_planner as gp
from gpu_planner import reference

INT64_MAX = 2**63 - 1
EDGES = [2**31, 2**32, 2**47, 2**62, 2**63]


def plan_and_reference(backend_device, src, dst, layout: dict, device_pages=None, max_batch=0):
    """(the backend's batches or its error, the reference's batches or its error)."""
    backend, device = backend_device

    def as_tensor(pages):
        return None if pages is None else torch.tensor(pages, dtype=torch.int64, device=device)

    try:
        planned = gp.plan_transfer(
            as_tensor(src),
            as_tensor(dst),
            gp.BufferLayout(**layout),
            dst_device_pages=as_tensor(device_pages),
            max_batch_pages=max_batch,
            backend=backend,
        )
        result = list_batches(planned)
    except gp.PlanValidationError as error:
        result = error
    try:
        expected = reference.plan_batches(
            src,
            dst,
            layout["src_ptrs"],
            layout["dst_ptrs"],
            layout["item_lens"],
            layout.get("dst_is_device"),
            device_pages,
            max_batch,
            layout.get("src_lens"),
            layout.get("dst_lens"),
        )
    except gp.PlanValidationError as error:
        expected = error
    return result, expected


def assert_refused(backend_device, error_type, message, *args, **kwargs):
    """The backend raises `error_type` matching `message`; the reference raises the same type."""
    result, expected = plan_and_reference(backend_device, *args, **kwargs)
    assert isinstance(result, error_type), result
    assert isinstance(expected, error_type), expected
    assert type(result) is type(expected)
    assert re.search(message, str(result)), str(result)


def test_page_times_item_len_wrapping_to_zero_is_out_of_bounds(backend_device):
    # 2**48 * 2**16 wraps to 0 in int64: the plan used to point at dst page 0.
    assert_refused(
        backend_device,
        gp.BoundsError,
        r"buffer 0: dst pages 281474976710656\.\.281474976710656 .*first page out of range: "
        r"281474976710656; buffer 0 is host-backed",
        [0],
        [2**48],
        {
            "src_ptrs": [1 << 40],
            "dst_ptrs": [1 << 41],
            "item_lens": [1 << 16],
            "dst_lens": [1 << 30],
        },
    )


def test_run_ending_at_the_last_int64_page_is_out_of_bounds(backend_device):
    # The run's end, 2**63, overflowed to a negative value and passed the check.
    assert_refused(
        backend_device,
        gp.BoundsError,
        r"buffer 0: src pages 9223372036854775806\.\.9223372036854775807 ",
        [INT64_MAX - 1, INT64_MAX],
        [0, 1],
        {"src_ptrs": [4096], "dst_ptrs": [8192], "item_lens": [1], "src_lens": [1 << 20]},
    )


def test_address_past_int64_without_registered_lengths_is_refused(backend_device):
    # Through Mooncake this wrapped to decode page 0 of every buffer.
    assert_refused(
        backend_device,
        gp.PlanValidationError,
        r"buffer 1: dst pages 144115188075855872\.\.144115188075855872 \(item_len 128\) end at "
        r"address \d+, past the int64 address space \(dst_ptrs\[1\] = 2199023255552",
        [0],
        [2**57],
        {"src_ptrs": [0, 1 << 40], "dst_ptrs": [0, 1 << 41], "item_lens": [1, 128]},
    )


def test_length_overflowing_int64_is_refused(backend_device):
    # 5 pages of 2**61 + 8 bytes: the length wrapped to a negative value.
    assert_refused(
        backend_device,
        gp.PlanValidationError,
        r"buffer 0: dst pages 0\.\.4 .*first page out of range: 3",
        [0, 1, 2, 3, 4],
        [0, 1, 2, 3, 4],
        {"src_ptrs": [4096], "dst_ptrs": [8192], "item_lens": [2**61 + 8]},
    )


def test_last_page_that_fits_the_address_space_is_planned(backend_device):
    ptr, item_len = 2**47 + 4096, 4096
    last_page = (INT64_MAX - ptr) // item_len - 1
    layout = {"src_ptrs": [0], "dst_ptrs": [ptr], "item_lens": [item_len]}
    result, expected = plan_and_reference(
        backend_device, [0, 1], [last_page - 1, last_page], layout
    )
    assert result == expected == [([0], [ptr + (last_page - 1) * item_len], [2 * item_len])]
    assert_refused(
        backend_device,
        gp.PlanValidationError,
        rf"first page out of range: {last_page + 1}",
        [0, 1],
        [last_page, last_page + 1],
        layout,
    )


def test_backends_name_the_first_descriptor_out_of_bounds(backend_device):
    # Buffer 1 passes its source length from run 1 on, buffer 2 its destination: the
    # first by buffer, then run, is buffer 1's run 1 (pages 40..41).
    layout = {
        "src_ptrs": [0, 2**40, 2**41],
        "dst_ptrs": [0, 2**42, 2**43],
        "item_lens": [16, 16, 16],
        "dst_is_device": [False, True, True],
        "src_lens": [2**20, 16 * 40, 2**20],
        "dst_lens": [2**20, 2**20, 16 * 3],
    }
    result, _ = plan_and_reference(
        backend_device, [1, 2, 40, 41], [0, 1, 5, 9], layout, device_pages=[0, 1, 2, 3]
    )
    assert isinstance(result, gp.BoundsError)
    assert str(result).startswith("buffer 1: src pages 40..41 (item_len 16) reach byte 672")


@st.composite
def edge_cases(draw) -> dict:
    """Pointers, item lengths, registered lengths and pages near the EDGES, and pages at the
    last page that fits a buffer: on both sides of every limit the planner computes."""

    def near(values, spread):
        value = draw(st.sampled_from(values)) + draw(st.integers(-spread, spread))
        return min(max(value, 0), INT64_MAX)

    num_buffers = draw(st.integers(1, 3))
    item_len_values = [1, 16, 4096, 2**16, *EDGES, 2**61 + 8]
    layout = {
        "src_ptrs": [near([0, 4096, *EDGES], 4096) for _ in range(num_buffers)],
        "dst_ptrs": [near([0, 4096, *EDGES], 4096) for _ in range(num_buffers)],
        "item_lens": [max(near(item_len_values, 2), 1) for _ in range(num_buffers)],
        "dst_is_device": draw(st.lists(st.booleans(), min_size=num_buffers, max_size=num_buffers)),
    }
    for side in ("src", "dst"):
        if draw(st.booleans()):
            ptrs = layout[f"{side}_ptrs"]
            lens = [near([2**20, *EDGES], 4096) for _ in range(num_buffers)]
            if draw(st.integers(0, 7)):  # mostly buffers that end inside int64
                lens = [
                    min(length, INT64_MAX - ptr) for length, ptr in zip(lens, ptrs, strict=True)
                ]
            layout[f"{side}_lens"] = lens
    num_pages = draw(st.integers(1, 6))

    def page_list(side, buffers):
        offsets = [0]
        for step in draw(
            st.lists(st.sampled_from([1, 1, 2, -3]), min_size=num_pages - 1, max_size=num_pages - 1)
        ):
            offsets.append(offsets[-1] + step)
        if buffers and draw(st.integers(0, 3)):  # the last page at the binding buffer's limit
            ptrs, item_lens = layout[f"{side}_ptrs"], layout["item_lens"]
            limits = layout.get(f"{side}_lens", [INT64_MAX - ptr for ptr in ptrs])
            fitting = min(limits[buffer] // item_lens[buffer] for buffer in buffers)
            base = fitting - 1 + draw(st.integers(-2, 1)) - max(offsets)
        else:
            base = near([0, *EDGES, 2**63 // 2**16, 2**63 // 4096], 8)
        return [min(max(base + offset, 0), INT64_MAX) for offset in offsets]

    device_space = layout["dst_is_device"]
    pages = {
        "src": page_list("src", range(num_buffers)),
        "dst": page_list("dst", [b for b in range(num_buffers) if not device_space[b]]),
        "device": page_list("dst", [b for b in range(num_buffers) if device_space[b]]),
    }
    return {"pages": pages, "layout": layout, "max_batch": draw(st.sampled_from([0, 1, 3]))}


SMALL_FITTING_CASE = {
    "pages": {
        "src": [2**31, 2**31 + 1, 5],
        "dst": [2**32, 2**32 + 1, 2**32 + 2],
        "device": [0, 1, 2],
    },
    "layout": {
        "src_ptrs": [2**47],
        "dst_ptrs": [2**47],
        "item_lens": [4096],
        "dst_is_device": [False],
    },
    "max_batch": 0,
}


@settings(max_examples=200)
@given(case=edge_cases())
@example(case=SMALL_FITTING_CASE)
def test_edge_values_match_reference(backend_device, case):
    """Near the int32/int64 edges a backend refuses what the reference refuses, else agrees."""
    pages = case["pages"]
    result, expected = plan_and_reference(
        backend_device,
        pages["src"],
        pages["dst"],
        case["layout"],
        pages["device"],
        case["max_batch"],
    )
    if isinstance(expected, Exception):
        assert isinstance(result, gp.PlanValidationError), (result, expected)
    else:
        assert result == expected
        for srcs, dsts, lens in result:
            for address, length in zip(srcs + dsts, lens + lens, strict=True):
                assert address >= 0 and address + length <= INT64_MAX and length > 0


@pytest.mark.parametrize(
    ("values", "shown"),
    [
        ([2**63, 1], "9223372036854775808"),
        ([2**64, 1], "18446744073709551616"),
        ([2**63, -1], "9223372036854775808"),
        (np.array([2**63, 1], dtype=np.uint64), "9223372036854775808"),
        ([10**5000, 1], f"{10**5000:#x}"),  # 5,001 digits: past Python's int-to-str limit
    ],
)
def test_pointer_outside_int64_is_named(values, shown):
    with pytest.raises(
        gp.PlanValidationError, match=rf"src_ptrs\[0\] = {shown}: does not fit in int64"
    ):
        gp.BufferLayout(values, [0, 0], [1, 1])


def test_non_integer_pointer_is_named():
    with pytest.raises(gp.PlanValidationError, match=r"dst_ptrs\[1\] = 1.5: expected an integer"):
        gp.BufferLayout([0, 0], [0, 1.5], [1, 1])


def test_buffer_ending_past_int64_is_refused():
    with pytest.raises(
        gp.PlanValidationError, match=r"dst_ptrs\[1\] \+ dst_lens\[1\] = 9223372036854775808"
    ):
        gp.BufferLayout([0, 0], [0, 2**62], [1, 1], dst_lens=[16, 2**62])


@pytest.mark.parametrize("as_input", [np.asarray, torch.from_numpy])
def test_uint64_page_at_or_above_2_63_is_reported_as_its_value(as_input):
    pages = as_input(np.array([0, 1, 2**64 - 1], dtype=np.uint64))
    with pytest.raises(
        gp.PlanValidationError, match=r"dst_pages\[2\] = 18446744073709551615: .*< 2\*\*63"
    ):
        gp.plan_transfer(np.arange(3), pages, gp.BufferLayout([0], [0], [1]))


def test_numpy_integer_sizes_are_accepted_and_bool_refused():
    slots = torch.arange(16)
    assert gp.kv_to_page_indices(slots, np.int64(4)).tolist() == [0, 1, 2, 3]
    layout = gp.BufferLayout([0], [0], [1])
    fragmented = np.array([0, 2, 4, 6])
    planned = gp.plan_transfer(fragmented, fragmented, layout, max_batch_pages=np.int32(2))
    assert planned.batch_offsets.tolist() == [0, 2, 4]
    with pytest.raises(
        gp.PlanValidationError, match=r"page_size: must be an integer >= 1 .*, got True"
    ):
        gp.kv_to_page_indices(slots, True)
    with pytest.raises(gp.PlanValidationError, match="max_batch_pages: .* got True"):
        gp.plan_transfer(fragmented, fragmented, layout, max_batch_pages=True)


@pytest.mark.parametrize("page_size", [2**62 + 1, INT64_MAX - 1, INT64_MAX])
def test_page_sizes_up_to_the_int64_limit_agree_on_every_backend(backend_device, page_size):
    # torch sized the slice as (tokens + step - 1) / step: near 2**63 it overflowed, or kept
    # no slot at all, while the kernels returned the first slot's page.
    backend, device = backend_device
    slot_values = [INT64_MAX, 2**62, 7, INT64_MAX - 1]
    slots = torch.tensor(slot_values, dtype=torch.int64, device=device)
    pages = gp.kv_to_page_indices(slots, page_size, backend=backend)
    assert pages.tolist() == [slot // page_size for slot in slot_values[::page_size]] == [1]
    host_slots = torch.tensor([0, INT64_MAX, 5, 6], device=device)
    both = gp.page_indices(slots, host_slots, 1, 4, page_size, backend=backend)
    assert both.device.tolist() == [2**62 // page_size] == [0]
    assert both.host.tolist() == [INT64_MAX // page_size] == [1]


@pytest.mark.parametrize("page_size", [2**63, 2**64, np.uint64(2**63)])
def test_page_sizes_past_int64_are_refused_on_every_backend(backend_device, page_size):
    backend, device = backend_device
    slots = torch.arange(8, device=device)
    message = r"page_size: must be an integer >= 1 and <= 2\*\*63 - 1"
    with pytest.raises(gp.PlanValidationError, match=message):
        gp.kv_to_page_indices(slots, page_size, backend=backend)
    with pytest.raises(gp.PlanValidationError, match=message):
        gp.page_indices(slots, slots, 0, 8, page_size, backend=backend)


@pytest.mark.parametrize("argument", ["src_ptrs", "dst_ptrs", "item_lens", "src_lens", "dst_lens"])
@pytest.mark.parametrize(
    "booleans",
    [[16, True], np.array([True, True]), torch.tensor([True, True])],
    ids=["list", "numpy", "torch"],
)
def test_booleans_are_no_pointer_or_length_on_any_backend(backend_device, argument, booleans):
    # NumPy turns [16, True] into [16, 1]: item_lens=[True] planned 1-byte pages.
    layout = {
        "src_ptrs": [4096, 8192],
        "dst_ptrs": [4096, 8192],
        "item_lens": [16, 16],
        "src_lens": [1 << 20, 1 << 20],
        "dst_lens": [1 << 20, 1 << 20],
        argument: booleans,
    }
    assert_refused(
        backend_device, gp.PlanValidationError, rf"^{argument}\b.*bool", [0, 1], [0, 1], layout
    )


def test_dst_is_device_takes_booleans():
    layout = gp.BufferLayout([0, 64], [0, 64], [16, 16], dst_is_device=np.array([False, True]))
    assert layout.dst_is_device.tolist() == [False, True]

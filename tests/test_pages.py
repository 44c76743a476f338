"""Page conversion equals `slots[start:end:page_size] // page_size` on every backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gpu_planner as gp


def expected_pages(slots: list[int], start: int, end: int, page_size: int) -> list[int]:
    return [slot // page_size for slot in slots[start:end:page_size]]


@st.composite
def requests(draw):
    num_tokens = draw(st.integers(0, 700))
    page_size = draw(st.sampled_from([1, 2, 16, 64]))
    start = draw(st.integers(0, num_tokens))
    end = draw(st.integers(start, num_tokens))
    seed = draw(st.integers(0, 2**32 - 1))
    return num_tokens, page_size, start, end, seed


@given(request=requests(), dtype=st.sampled_from([torch.int32, torch.int64]), strided=st.booleans())
def test_page_indices_both_spaces(backend_device, request, dtype, strided):
    backend, device = backend_device
    num_tokens, page_size, start, end, seed = request
    rng = np.random.default_rng(seed)
    device_slots = rng.integers(0, 2**30, num_tokens)
    host_slots = rng.integers(0, 2**30, num_tokens)
    if strided:  # a non-contiguous view: every other element of a doubled row
        row = torch.from_numpy(np.repeat(device_slots, 2)).to(device, dtype)[::2]
    else:
        row = torch.from_numpy(device_slots).to(device, dtype)
    host = torch.from_numpy(host_slots).to(device, dtype)
    pages = gp.page_indices(row, host, start, end, page_size, backend=backend)
    assert pages.device.cpu().tolist() == expected_pages(
        device_slots.tolist(), start, end, page_size
    )
    assert pages.host.cpu().tolist() == expected_pages(host_slots.tolist(), start, end, page_size)
    assert pages.host.dtype == dtype and pages.device.device.type == device.type


@st.composite
def two_space_requests(draw):
    """A device range and page size, and a host range and page size of their own."""
    spaces = []
    for _ in range(2):
        num_tokens = draw(st.integers(0, 600))
        start = draw(st.integers(0, num_tokens))
        end = draw(st.integers(start, num_tokens))
        spaces.append((num_tokens, start, end, draw(st.sampled_from([1, 2, 4, 16, 64, 256]))))
    return spaces, draw(st.integers(0, 2**32 - 1))


@given(
    request=two_space_requests(),
    dtypes=st.sampled_from([(torch.int64, torch.int32), (torch.int32, torch.int64)]),
)
def test_page_indices_spaces_of_their_own(backend_device, request, dtypes):
    """Each space converts its own range with its own page size (HiSparse's compressed host)."""
    backend, device = backend_device
    (host_space, device_space), seed = request
    rng = np.random.default_rng(seed)
    host_slots, device_slots = (rng.integers(0, 2**30, space[0]) for space in request[0])
    host = torch.from_numpy(host_slots).to(device, dtypes[0])
    row = torch.from_numpy(device_slots).to(device, dtypes[1])
    _, start, end, page_size = device_space
    _, host_start, host_end, host_page_size = host_space
    pages = gp.page_indices(
        row,
        host,
        start,
        end,
        page_size,
        backend=backend,
        host_range=(host_start, host_end),
        host_page_size=host_page_size,
    )
    assert pages.host.cpu().tolist() == expected_pages(
        host_slots.tolist(), host_start, host_end, host_page_size
    )
    assert pages.device.cpu().tolist() == expected_pages(
        device_slots.tolist(), start, end, page_size
    )
    assert (pages.host.dtype, pages.device.dtype) == dtypes


@given(num_tokens=st.integers(0, 500), page_size=st.sampled_from([1, 3, 64]))
def test_kv_to_page_indices(backend_device, num_tokens, page_size):
    backend, device = backend_device
    slots = np.random.default_rng(num_tokens).integers(0, 2**40, num_tokens)
    pages = gp.kv_to_page_indices(torch.from_numpy(slots).to(device), page_size, backend=backend)
    assert pages.cpu().tolist() == expected_pages(slots.tolist(), 0, num_tokens, page_size)


def test_kv_to_page_indices_numpy_in_numpy_out():
    slots = np.arange(10, 50, dtype=np.int32)
    pages = gp.kv_to_page_indices(slots, 8)
    assert isinstance(pages, np.ndarray) and pages.dtype == np.int32
    assert pages.tolist() == expected_pages(slots.tolist(), 0, len(slots), 8)


@pytest.mark.parametrize("page_size", [0, -4, 2.0])
def test_bad_page_size_is_named(page_size):
    with pytest.raises(gp.PlanValidationError, match="page_size"):
        gp.kv_to_page_indices(torch.arange(8), page_size)


def test_token_range_outside_row_is_named():
    with pytest.raises(gp.PlanValidationError, match=r"token range \[0, 9\).*host_slots"):
        gp.page_indices(torch.arange(16), torch.arange(8), 0, 9, 4)


def test_host_range_outside_host_slots_is_named():
    with pytest.raises(gp.PlanValidationError, match=r"token range \[2, 9\).*host_slots"):
        gp.page_indices(torch.arange(16), torch.arange(8), 0, 16, 4, host_range=(2, 9))
    with pytest.raises(gp.PlanValidationError, match="page_size"):
        gp.page_indices(torch.arange(16), torch.arange(8), 0, 16, 4, host_page_size=0)

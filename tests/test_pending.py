"""page_indices_async, the decode-side staging path: every backend; no device-wide sync on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from suite_support import ON_CUDA

import gpu_planner as gp


def _request_slots(rng: np.random.Generator, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """A request's token slots in two unrelated index spaces (device row and host slots)."""
    device_slots = rng.permutation(4 * tokens + 8)[:tokens]
    host_slots = rng.permutation(6 * tokens + 8)[:tokens] + 3
    return device_slots, host_slots


@given(
    tokens=st.integers(0, 300),
    page_size=st.sampled_from([1, 3, 16]),
    data=st.data(),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_pending_pages_match_the_definition(backend_device, tokens, page_size, data, dtype):
    backend, device = backend_device
    device_slots, host_slots = _request_slots(np.random.default_rng(tokens), tokens)
    start = data.draw(st.integers(0, tokens))
    end = data.draw(st.integers(start, tokens))
    pending = gp.page_indices_async(
        torch.from_numpy(device_slots).to(device, dtype),
        torch.from_numpy(host_slots).to(device, dtype),
        start,
        end,
        page_size,
        backend=backend,
    )
    pages = pending.numpy()
    assert pending.ready()
    np.testing.assert_array_equal(pages.device, device_slots[start:end:page_size] // page_size)
    np.testing.assert_array_equal(pages.host, host_slots[start:end:page_size] // page_size)
    host = pending.wait()
    assert (host.host.device.type, host.device.device.type) == ("cpu", "cpu")
    assert host.host.dtype == host.device.dtype == dtype
    assert pending.computed.device.device.type == device.type


@pytest.mark.parametrize("host_dtype", [torch.int32, torch.int64])
def test_both_spaces_come_back_in_one_copy(host_cuda, host_dtype):
    """One launch writes both spaces into one allocation; one copy and one wait bring them."""
    device_slots, host_slots = _request_slots(np.random.default_rng(3), 700)
    row = torch.from_numpy(device_slots).to(torch.int32)
    host = torch.from_numpy(host_slots[:175]).to(host_dtype)
    copies, waits = host_cuda.copies, host_cuda.host_waits
    pending = gp.page_indices_async(
        row, host, 0, 700, 64, "triton", host_range=(0, 175), host_page_size=16
    )
    pages = pending.numpy()
    assert (host_cuda.copies - copies, host_cuda.host_waits - waits) == (1, 1)
    np.testing.assert_array_equal(pages.device, device_slots[::64] // 64)
    np.testing.assert_array_equal(pages.host, host_slots[:175:16] // 16)
    assert (pages.host.dtype, pages.device.dtype) == (host.numpy().dtype, np.int32)


def test_numpy_input_gives_numpy_pages():
    device_slots, host_slots = _request_slots(np.random.default_rng(1), 100)
    pending = gp.page_indices_async(device_slots, host_slots, 5, 97, 8)
    host = pending.wait()
    assert isinstance(host.host, np.ndarray) and isinstance(host.device, np.ndarray)
    np.testing.assert_array_equal(pending.numpy().device, device_slots[5:97:8] // 8)


def test_bad_arguments_raise_before_any_work():
    slots = np.arange(10)
    with pytest.raises(gp.PlanValidationError, match=r"token range \[0, 11\)"):
        gp.page_indices_async(slots, slots, 0, 11, 4)
    with pytest.raises(gp.PlanValidationError, match="page_size"):
        gp.page_indices_async(slots, slots, 0, 10, 0)


@pytest.mark.skipif(not ON_CUDA, reason="no CUDA device (the triton-interpreter twin runs)")
def test_cuda_staging_waits_on_its_copy_event_only():
    device_slots, host_slots = _request_slots(np.random.default_rng(2), 1 << 16)
    row = torch.from_numpy(device_slots).cuda()
    host = torch.from_numpy(host_slots).cuda()
    arguments = (row, host, 7, row.numel() - 5, 64)
    gp.page_indices_async(*arguments).wait()  # compile and pin outside the check
    busy = torch.cuda.Stream()  # a non-blocking stream: no implicit sync with the default one
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(busy):
            torch.cuda._sleep(2_000_000_000)  # about a second of work on another stream
        pending = gp.page_indices_async(*arguments)
        pages = pending.numpy()
        # The wait returned while the device was still busy: it waited on the copy event alone.
        assert not busy.query()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    np.testing.assert_array_equal(pages.device, device_slots[7:-5:64] // 64)
    np.testing.assert_array_equal(pages.host, host_slots[7:-5:64] // 64)
    assert pending.computed.host.is_cuda
    busy.synchronize()

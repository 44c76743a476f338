"""A HiSparse decode's two page lists of a request: one launch, one copy, one wait, sglang's bytes.

`prealloc_steps` makes the calls `DecodePreallocQueue.pop_preallocated`
(sglang 0.5.23, decode.py:1611-1823) makes for one request, on a queue with
just what they read: `_pre_alloc` (the plugin's hook around a stand-in
that returns the request's host slots, as sglang's returns
`alloc_paged_token_slots`' view), optionally a state payload over the same
row, the device space through decode's hooked `kv_to_page_indices`, and the
host space through sglang's own `_transfer_page_indices`. Every list is
compared, values and dtype, with sglang's own `kv_to_page_indices` on the
same input. The `cuda_path` fixture runs the CUDA path on CPU tensors through
the host stand-in and the Triton interpreter (tests/cuda_standin.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
from sglang_plugin_support import ORIGINALS, page_importer

from gpu_planner.integration.sglang import counters, decode_pages
from gpu_planner.kernels import launcher

QUEUE = page_importer.DecodePreallocQueue
ROWS = 4  # request slots of the queue's req_to_token and req_to_host_pool


def make_queue(device, tokens, page_size, ratio, host_page_size, two_spaces=True, seed=0):
    """A decode queue of HiSparse with a draft pool (or none), its pools filled with random
    slots: `req_to_token` int32, the host slots int64, `tokens // ratio` of them per row."""
    rng = np.random.default_rng(seed)
    width = tokens + 8
    req_to_token = torch.from_numpy(rng.integers(0, 2**31 - 1, (ROWS, width))).to(torch.int32)
    req_to_host_pool = torch.from_numpy(rng.integers(0, 2**40, (ROWS, width)))
    return SimpleNamespace(
        scheduler=SimpleNamespace(enable_hisparse=True),
        token_to_kv_pool=object(),
        draft_token_to_kv_pool=object() if two_spaces else None,
        transfer_backend=page_importer.TransferBackend.MOONCAKE,
        token_to_kv_pool_allocator=SimpleNamespace(
            page_size=page_size, hisparse_page_size=host_page_size
        ),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token.to(device)),
        req_to_host_pool=req_to_host_pool.to(device),
        ratio=ratio,
        _rebootstrap_prefill_len=QUEUE._rebootstrap_prefill_len,
    )


def make_request(tokens, row):
    return SimpleNamespace(
        origin_input_ids=list(range(tokens)),
        output_ids=[],
        bootstrap_host="10.0.0.2",
        kv=SimpleNamespace(req_pool_idx=row),
    )


def prealloc_steps(queue, req, payload=False, after_pre_alloc=None, between_spaces=None):
    """The page lists sglang's `pop_preallocated` makes for `req`: (state pages or None, device
    pages, host pages), each as sglang passes it on; the callbacks run where they say."""

    def alloc_paged_token_slots(queue, req, *_):  # sglang's `_pre_alloc` under HiSparse
        host_len = len(req.origin_input_ids) // queue.ratio
        return queue.req_to_host_pool[req.kv.req_pool_idx, 0:host_len]

    prefix_len = 0  # HiSparse asserts no device prefix
    origin_input_len = QUEUE._rebootstrap_prefill_len(req)
    dst_kv_indices = decode_pages.pre_alloc_hook(
        alloc_paged_token_slots, queue, req, None, prefix_len, prefix_len
    )
    if after_pre_alloc is not None:
        after_pre_alloc()
    page_size = queue.token_to_kv_pool_allocator.page_size
    kv_transfer_page_size = queue.token_to_kv_pool_allocator.hisparse_page_size
    kv_indices = dst_kv_indices[: origin_input_len - prefix_len]
    req_to_token = queue.req_to_token_pool.req_to_token
    state = None
    if payload:  # `_full_kv_pages_payload`: the same row, with the device pool's page size
        state = page_importer.kv_to_page_indices(
            req_to_token[req.kv.req_pool_idx, :origin_input_len], page_size
        )
    device_pages = page_importer.kv_to_page_indices(
        req_to_token[req.kv.req_pool_idx, prefix_len:origin_input_len], page_size
    ).astype(np.int32)
    if between_spaces is not None:
        between_spaces()
    host_pages = QUEUE._transfer_page_indices(queue, None, kv_indices, kv_transfer_page_size)
    return state, device_pages, host_pages


def in_pop_preallocated(steps):
    """`steps` run inside the plugin's hook around `pop_preallocated`, as sglang runs them."""
    return decode_pages.pop_preallocated_hook(lambda queue: steps(), None)


def sglang_lists(queue, req):
    """What sglang's own `kv_to_page_indices` gives for the request's three inputs."""
    original = ORIGINALS["pages"]
    row = queue.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    host = queue.req_to_host_pool[req.kv.req_pool_idx]
    tokens = len(req.origin_input_ids)
    page_size = queue.token_to_kv_pool_allocator.page_size
    host_page_size = queue.token_to_kv_pool_allocator.hisparse_page_size
    return (
        original(row[:tokens], page_size),
        original(row[:tokens], page_size).astype(np.int32),
        original(host[: tokens // queue.ratio][:tokens], host_page_size).astype(np.int32),
    )


def assert_same_bytes(found: np.ndarray, expected: np.ndarray) -> None:
    assert found.dtype == expected.dtype and found.shape == expected.shape
    assert found.tobytes() == expected.tobytes()


def kernel_launches() -> int:
    return sum(launcher.launch_counts.get("_page_indices_kernel", [0, 0]))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    tokens=st.integers(0, 700),
    page_size=st.sampled_from([1, 4, 64, 256]),
    ratio=st.sampled_from([1, 4]),
    host_page_size=st.sampled_from([1, 2, 16, 64]),
    row=st.integers(0, ROWS - 1),
    payload=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_both_spaces_equal_sglangs_lists(
    cuda_path, tokens, page_size, ratio, host_page_size, row, payload, seed
):
    queue = make_queue(cuda_path, tokens, page_size, ratio, host_page_size, seed=seed)
    req = make_request(tokens, row)
    state, device_pages, host_pages = in_pop_preallocated(
        lambda: prealloc_steps(queue, req, payload)
    )
    expected_state, expected_device, expected_host = sglang_lists(queue, req)
    assert_same_bytes(device_pages, expected_device)
    assert_same_bytes(host_pages, expected_host)
    if payload:
        assert_same_bytes(state, expected_state)
    assert decode_pages._prealloc.get() is None  # nothing kept once pop_preallocated returns


@pytest.mark.parametrize("two_spaces, payload", [(True, False), (False, False), (True, True)])
def test_one_launch_copy_and_wait_per_request(host_cuda, two_spaces, payload):
    """Both spaces of a request: one launch, one copy, one wait (two of each without the
    hooks around `pop_preallocated` and `_pre_alloc`, or outside sglang's two-space case).
    A state payload over the same row takes the device list first; a list is handed out once,
    so the device space's own call converts again."""
    queue = make_queue(torch.device("cpu"), 1000, 64, 4, 16, two_spaces=two_spaces)
    requests = [make_request(1000, row) for row in range(ROWS)]
    in_pop_preallocated(lambda: prealloc_steps(queue, requests[0]))  # compiles
    for req in requests[1:]:
        launches, copies, waits = kernel_launches(), host_cuda.copies, host_cuda.host_waits
        _, device_pages, host_pages = in_pop_preallocated(
            lambda: prealloc_steps(queue, req, payload)  # noqa: B023
        )
        calls = 1 if two_spaces else 2
        calls += payload
        assert kernel_launches() - launches == calls
        assert (host_cuda.copies - copies, host_cuda.host_waits - waits) == (calls, calls)
        _, expected_device, expected_host = sglang_lists(queue, req)
        assert_same_bytes(device_pages, expected_device)
        assert_same_bytes(host_pages, expected_host)
    launches = kernel_launches()
    prealloc_steps(queue, requests[1])  # outside pop_preallocated: each space alone
    assert kernel_launches() - launches == 2


@pytest.mark.parametrize(
    "written, when",
    [("device", "after_pre_alloc"), ("host", "after_pre_alloc"), ("host", "between_spaces")],
)
def test_slots_written_after_pre_alloc_are_converted_as_they_are_then(host_cuda, written, when):
    """An in-place write to a space's slots after `_pre_alloc` (or after the first space was
    converted) retires what was kept: each list is what sglang's code gives for the slots as
    they are at its call."""
    queue = make_queue(torch.device("cpu"), 300, 4, 1, 4)
    req = make_request(300, 2)

    def write():
        pool = (
            queue.req_to_token_pool.req_to_token if written == "device" else queue.req_to_host_pool
        )
        pool[2, 0:8] = 4096

    _, device_pages, host_pages = in_pop_preallocated(
        lambda: prealloc_steps(queue, req, **{when: write})
    )
    _, expected_device, expected_host = sglang_lists(queue, req)
    assert_same_bytes(device_pages, expected_device)
    assert_same_bytes(host_pages, expected_host)
    assert (device_pages[:2] if written == "device" else host_pages[:2]).tolist() == [1024, 1024]


def test_a_queue_outside_the_two_space_case_keeps_nothing(host_cuda):
    """Not HiSparse, a fake transfer, or another backend: sglang converts one space (or none),
    and `_pre_alloc` keeps nothing for the page hook."""
    req = make_request(64, 1)
    cases = {
        "not HiSparse": {"scheduler": SimpleNamespace(enable_hisparse=False)},
        "no draft, no DeepSeek-V4 pool": {"draft_token_to_kv_pool": None},
        "another backend": {"transfer_backend": page_importer.TransferBackend.NIXL},
    }
    for changes in cases.values():
        queue = make_queue(torch.device("cpu"), 64, 4, 1, 4)
        vars(queue).update(changes)
        assert decode_pages.two_space_pages(queue, req, queue.req_to_host_pool[1], 0) is None
    fake = make_request(64, 1)
    fake.bootstrap_host = FAKE_BOOTSTRAP_HOST
    queue = make_queue(torch.device("cpu"), 64, 4, 1, 4)
    assert decode_pages.two_space_pages(queue, fake, queue.req_to_host_pool[1], 0) is None
    assert decode_pages.two_space_pages(queue, req, queue.req_to_host_pool[1], 0) is not None


def test_a_failed_keep_is_counted_and_sglang_result_returned(host_cuda):
    """`_pre_alloc`'s hook returns sglang's result even when keeping fails (counted)."""
    queue = make_queue(torch.device("cpu"), 64, 4, 1, 4)
    del queue.req_to_token_pool.req_to_token
    before = counters.snapshot()["fallbacks"].get("two spaces", 0)
    host = queue.req_to_host_pool[0]
    kept = in_pop_preallocated(
        lambda: decode_pages.pre_alloc_hook(lambda *_: host, queue, make_request(64, 0))
    )
    assert kept is host
    assert counters.snapshot()["fallbacks"]["two spaces"] == before + 1

"""The Triton path on streams, threads and devices, against the CPU backend.

On a CUDA machine these run the kernels on the GPU (what scripts/gpu_check.sh
runs); without one, the thread tests run their twins on the Triton
interpreter, and the GPU-only behaviours (stream ordering, device guards,
sync-debug, graph replay) are skipped with the reason. The descriptor values
of every shape are checked against the reference in tests/test_plan.py on
every backend; here the CPU backend is the oracle.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from suite_support import ON_CUDA

import gpu_planner as gp
from gpu_planner.kernels import interpreter_enabled
from gpu_planner.testing import fragmented_pages

DEVICE = torch.device("cuda") if ON_CUDA else torch.device("cpu")
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="no CUDA device (interpreter twins run)")
needs_kernels = pytest.mark.skipif(
    not (ON_CUDA or interpreter_enabled()), reason="neither CUDA nor the Triton interpreter"
)
BUSY_CYCLES = 2_000_000_000  # about a second of device work for torch.cuda._sleep


def request(num_pages: int, num_buffers: int, seed: int):
    """Fragmented src/host/device pages and a layout with every other buffer device-backed."""
    rng = np.random.default_rng(seed)
    pages = [fragmented_pages(num_pages, 8.0, rng) for _ in range(3)]
    item_len = 64 * 1152
    layout = gp.BufferLayout(
        src_ptrs=[(1 << 40) + (b << 34) for b in range(num_buffers)],
        dst_ptrs=[(1 << 41) + (b << 34) for b in range(num_buffers)],
        item_lens=[item_len] * num_buffers,
        dst_is_device=[b % 2 == 1 for b in range(num_buffers)],
    )
    return pages, layout


def expected_columns(pages, layout, max_batch_pages=0) -> np.ndarray:
    src, dst, dst_device = pages
    plan = gp.plan_transfer(src, dst, layout, dst_device, max_batch_pages, backend="cpu")
    return plan.columns_array()


def pages_on(device: torch.device, pages) -> list[torch.Tensor]:
    """The request's three page lists as tensors on `device`."""
    return [torch.from_numpy(values).to(device) for values in pages]


def plan_on(device: torch.device, pages, layout, max_batch_pages=0) -> gp.TransferPlan:
    src, dst, dst_device = pages_on(device, pages)
    return gp.plan_transfer(src, dst, layout, dst_device, max_batch_pages, backend="triton")


@needs_kernels
def test_a_plan_made_in_one_thread_reads_complete_in_another():
    pages, layout = request(3000, 5, seed=1)
    with ThreadPoolExecutor(1) as planner:
        plan = planner.submit(plan_on, DEVICE, pages, layout, 1024).result()
    np.testing.assert_array_equal(plan.columns_array(), expected_columns(pages, layout, 1024))


@needs_kernels
def test_two_threads_plan_at_once_each_on_its_own_stream():
    """On the interpreter, which patches triton.language while a kernel runs, the
    threads take turns for each plan (the twin checks the Python side only)."""
    requests = [request(2048, 7, seed) for seed in range(8)]
    interpreter_turns = threading.Lock()

    def plan_all(first: int) -> list[np.ndarray]:
        columns = []
        if not ON_CUDA:
            for pages, layout in requests[first::2]:
                with interpreter_turns:
                    plan = plan_on(DEVICE, pages, layout)
                columns.append(plan.columns_array())
            return columns
        with torch.cuda.stream(torch.cuda.Stream()):
            for pages, layout in requests[first::2]:
                columns.append(plan_on(DEVICE, pages, layout).columns_array())
        return columns

    with ThreadPoolExecutor(2) as threads:
        results = list(threads.map(plan_all, (0, 1)))
    for first, columns in enumerate(results):
        for (pages, layout), planned in zip(requests[first::2], columns, strict=True):
            np.testing.assert_array_equal(planned, expected_columns(pages, layout))


@needs_kernels
def test_more_buffers_than_a_grid_column_holds_is_a_clear_error():
    pages, _ = request(16, 1, seed=9)
    too_many = 65536
    layout = gp.BufferLayout([0] * too_many, [0] * too_many, [1] * too_many)
    with pytest.raises(gp.PlanValidationError, match="65536 buffers"):
        plan_on(DEVICE, pages, layout)


@needs_cuda
def test_plan_on_a_busy_side_stream_read_from_another_thread():
    """The reader's stream is idle; only the plan's event orders its read after the kernels."""
    pages, layout = request(2048, 61, seed=2)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY_CYCLES)  # the plan's kernels queue behind this
        plan = plan_on(DEVICE, pages, layout)
    with ThreadPoolExecutor(1) as reader:
        columns = reader.submit(plan.columns_array).result()
    np.testing.assert_array_equal(columns, expected_columns(pages, layout))


@needs_cuda
def test_reading_a_plan_never_waits_for_the_callers_stream():
    pages, layout = request(2048, 61, seed=3)
    plan = plan_on(DEVICE, pages, layout)
    caller = torch.cuda.current_stream()
    torch.cuda._sleep(BUSY_CYCLES)  # unrelated work (a forward pass) queued after the plan
    columns = plan.columns_array()
    assert not caller.query(), "the read waited for work queued after the plan"
    np.testing.assert_array_equal(columns, expected_columns(pages, layout))
    caller.synchronize()


@needs_cuda
def test_plan_transfer_and_its_read_never_synchronise_the_host_otherwise():
    pages, layout = request(2048, 61, seed=4)
    plan_on(DEVICE, pages, layout).materialize()  # tables copied, blocks pinned
    src, dst, dst_device = pages_on(DEVICE, pages)  # the caller's pages, already on the GPU
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = gp.plan_transfer(src, dst, layout, dst_device, 1024, backend="triton")
        columns = plan.columns_array()  # waits on events only
    finally:
        torch.cuda.set_sync_debug_mode(0)
    np.testing.assert_array_equal(columns, expected_columns(pages, layout, 1024))


@needs_cuda
def test_a_million_pages_match_the_cpu_backend():
    pages, layout = request(1 << 20, 61, seed=5)
    for max_batch_pages in (0, 1024):
        plan = plan_on(DEVICE, pages, layout, max_batch_pages)
        np.testing.assert_array_equal(
            plan.columns_array(), expected_columns(pages, layout, max_batch_pages)
        )


@needs_cuda
def test_cuda_graph_replay_of_plan_transfer():
    """Captured once for a fixed shape, replayed on new pages, read after the replay."""
    first, layout = request(2048, 61, seed=6)
    second, _ = request(2048, 61, seed=7)
    static = [torch.from_numpy(values).cuda() for values in first]
    gp.plan_transfer(*static[:2], layout, static[2]).materialize()  # warm: compile, tables
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = gp.plan_transfer(*static[:2], layout, static[2])
    for tensor, values in zip(static, second, strict=True):
        tensor.copy_(torch.from_numpy(values))
    graph.replay()
    np.testing.assert_array_equal(plan.columns_array(), expected_columns(second, layout))


@pytest.mark.skipif(not ON_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_plan_runs_on_its_pages_device_whatever_device_is_current():
    pages, layout = request(2048, 61, seed=8)
    other = torch.device("cuda", 1)
    finished = threading.Event()

    def plan_from_a_new_thread() -> np.ndarray:  # new threads start on device 0
        plan = plan_on(other, pages, layout)
        finished.set()
        return plan.columns_array()

    with ThreadPoolExecutor(1) as thread:
        columns = thread.submit(plan_from_a_new_thread).result()
    assert finished.is_set()
    np.testing.assert_array_equal(columns, expected_columns(pages, layout))
    with pytest.raises(gp.PlanValidationError, match="one device"):
        gp.plan_transfer(torch.arange(4, device="cuda:0"), torch.arange(4, device=other), layout)


@needs_cuda
def test_memory_device_is_the_buffers_device_in_any_thread():
    """sglang's transfer threads never select a device: the KV's device comes from its memory.

    The stand-in twin is tests/integration/sglang/test_gathered.py's device test.
    """
    from gpu_planner.cuda_runtime import cuda_runtime

    buffers = {
        torch.device("cuda", index): torch.empty(4096, dtype=torch.uint8, device=f"cuda:{index}")
        for index in range(torch.cuda.device_count())
    }
    host = torch.empty(4096, dtype=torch.uint8)
    pinned = torch.empty(4096, dtype=torch.uint8).pin_memory()

    def devices_seen() -> dict:
        return {
            device: cuda_runtime().memory_device(buffer.data_ptr() + 100)
            for device, buffer in buffers.items()
        } | {
            "host": cuda_runtime().memory_device(host.data_ptr()),
            "pinned": cuda_runtime().memory_device(pinned.data_ptr()),
        }

    with ThreadPoolExecutor(max_workers=1) as thread:  # a new thread: current device 0
        seen = thread.submit(devices_seen).result()
    expected = {device: device for device in buffers} | {
        "host": torch.device("cpu"),
        "pinned": torch.device("cpu"),
    }
    assert seen == expected

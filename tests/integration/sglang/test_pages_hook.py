"""The page hook's results through sglang's own `kv_to_page_indices`, in decode's order.

Decode computes a request's SWA state pages, then its KV pages, and only then
serialises both. On CUDA the hook copies each list through pinned staging;
the first list must not change when the second is copied. The `cuda_path`
fixture runs the hook's CUDA path on CPU tensors through the host stand-in
(tests/cuda_standin.py), and on a real device where there is one.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from sglang_plugin_support import ORIGINALS, common, page_importer

from gpu_planner.integration.sglang import counters, pages


@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_state_pages_survive_the_kv_pages_copy(cuda_path, page_size):
    swa_slots = torch.arange(300 * page_size, 304 * page_size, device=cuda_path)
    kv_slots = torch.arange(7 * page_size, 11 * page_size, device=cuda_path)
    state_pages = [common.kv_to_page_indices(swa_slots, page_size)]
    kv_pages = page_importer.kv_to_page_indices(kv_slots, page_size).astype(np.int32)
    assert state_pages[0].tolist() == [300, 301, 302, 303]
    assert kv_pages.tolist() == [7, 8, 9, 10]
    for _ in range(3):  # later requests' copies
        common.kv_to_page_indices(kv_slots + page_size, page_size)
    assert state_pages[0].tolist() == [300, 301, 302, 303]


def test_the_stand_in_runs_the_hooks_cuda_path(host_cuda):
    """On CPU tensors the hook copies through staging only under the stand-in."""
    kv = torch.randperm(5000)[:777]
    pages = common.kv_to_page_indices(kv, 16)
    assert host_cuda.copies == 1
    np.testing.assert_array_equal(pages, ORIGINALS["pages"](kv, 16))


@pytest.fixture
def page_path(monkeypatch):
    """A fresh measured choice for the hook, and a fresh once-only log."""
    from gpu_planner.integration.sglang import fallback

    choice = pages.PagePath()
    monkeypatch.setattr(pages, "PAGE_PATH", choice)
    monkeypatch.setattr(fallback, "_logged_keys", set())
    return choice


def test_calls_near_a_size_sglang_won_go_to_sglang(host_cuda, page_path, caplog):
    """Injected timings: sglang measured faster at 131072 pages, the hook at 1024. A call
    goes where its nearest measured size (in pages, log scale) went: counted, logged once
    with the figures, and sglang's own result either way."""
    page_path.choose(
        [
            pages.PageTiming(1024, hook_s=10e-6, sglang_s=30e-6),
            pages.PageTiming(131072, hook_s=900e-6, sglang_s=600e-6),
        ]
    )
    before = counters.snapshot()["fallbacks"].get(pages.SGLANG_FASTER, 0)
    small, large = torch.randperm(1 << 14)[:2000], torch.randperm(1 << 20)[: 1 << 17]
    with caplog.at_level(logging.INFO, logger="gpu_planner.integration.sglang.plugin"):
        for kv, page_size, hooked in ((small, 1, True), (large, 1, False), (large, 64, True)):
            copies = host_cuda.copies
            found = common.kv_to_page_indices(kv, page_size)
            assert (host_cuda.copies - copies == 1) == hooked
            expected = ORIGINALS["pages"](kv, page_size)
            assert found.dtype == expected.dtype and found.tobytes() == expected.tobytes()
        common.kv_to_page_indices(large, 1)
    assert counters.snapshot()["fallbacks"][pages.SGLANG_FASTER] == before + 2
    [logged] = [r.getMessage() for r in caplog.records if pages.SGLANG_FASTER in r.getMessage()]
    assert "131072 pages: hook 900.0 us, sglang 600.0 us -> sglang" in logged


def test_without_measurements_the_hook_converts(host_cuda, page_path):
    assert page_path.sglang_faster(1) is None and page_path.sglang_faster(1 << 20) is None
    pages.choose_page_path()  # no CUDA here: nothing measured, nothing chosen
    assert page_path.sglang_faster(1 << 20) is None


def test_measuring_times_both_paths_on_each_input(host_cuda, page_path, caplog):
    """The timing runs both paths on each input through the stand-in (no speeds asserted) and
    the choice logs its figures."""
    timings = pages.measure_page_paths(
        torch.device("cpu"), ORIGINALS["pages"], [(64, 1), (1000, 16)], timed_calls=3
    )
    assert [timing.num_pages for timing in timings] == [64, 63]
    assert all(timing.hook_s > 0 and timing.sglang_s > 0 for timing in timings)
    with caplog.at_level(logging.INFO, logger="gpu_planner.integration.sglang.plugin"):
        page_path.choose(timings)
    assert "64 pages: hook" in caplog.text and "63 pages: hook" in caplog.text

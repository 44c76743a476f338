"""The page hook's results through sglang's own `kv_to_page_indices`, in decode's order.

Decode computes a request's SWA state pages, then its KV pages, and only then
serialises both. On CUDA the hook copies each list through pinned staging;
the first list must not change when the second is copied. The `cuda_path`
fixture runs the hook's CUDA path on CPU tensors through the host stand-in
(tests/cuda_standin.py), and on a real device where there is one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang_plugin_support import ORIGINALS, common, page_importer


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

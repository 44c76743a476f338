"""group_runs on every backend equals the reference's runs, per batch, for both spaces."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from pages_strategies import page_lists

import gpu_planner as gp
from gpu_planner import reference
from gpu_planner.testing import fragmented_pages


def reference_runs(src, dst, max_batch_pages):
    """Runs of every batch, concatenated, and the first run index of each batch."""
    runs, batch_run_offsets = [], [0]
    for cut in reference.batch_slices(len(src), max_batch_pages):
        runs += reference.group_runs(list(src[cut]), list(dst[cut]))
        batch_run_offsets.append(len(runs))
    return runs, batch_run_offsets


def as_tuples(space_runs: gp.SpaceRuns) -> list[tuple[int, int, int]]:
    columns = (space_runs.src_starts, space_runs.dst_starts, space_runs.lengths)
    return list(zip(*(column.cpu().tolist() for column in columns), strict=True))


@given(pages=page_lists(), max_batch_pages=st.sampled_from([0, 1, 7, 1024]))
def test_runs_match_reference(backend_device, pages, max_batch_pages):
    backend, device = backend_device
    src, dst, dev = (torch.from_numpy(pages[k]).to(device) for k in ("src", "dst", "device"))
    runs = gp.group_runs(src, dst, dev, max_batch_pages=max_batch_pages, backend=backend)
    for space, dst_pages in ((runs.host, pages["dst"]), (runs.device, pages["device"])):
        expected_runs, expected_offsets = reference_runs(pages["src"], dst_pages, max_batch_pages)
        assert as_tuples(space) == expected_runs
        assert space.batch_run_offsets.cpu().tolist() == expected_offsets
        assert space.src_starts.device.type == device.type
    assert runs.num_batches == len(expected_offsets) - 1


def test_host_only_runs_have_no_device_plan(backend_device):
    backend, device = backend_device
    pages = torch.arange(10, device=device)
    runs = gp.group_runs(pages, pages, backend=backend)
    assert runs.device is None
    assert as_tuples(runs.host) == [(0, 0, 10)]


def test_scan_handles_a_million_pages(backend_device):
    """2**20 pages span 1024 scan blocks: block offsets must carry across all of them."""
    backend, device = backend_device
    max_batch_pages = 1000
    rng = np.random.default_rng(20)
    num_pages = 2**20
    src = fragmented_pages(num_pages, 8.0, rng)
    dst = fragmented_pages(num_pages, 8.0, rng)
    runs = gp.group_runs(
        torch.from_numpy(src).to(device),
        torch.from_numpy(dst).to(device),
        max_batch_pages=max_batch_pages,
        backend=backend,
    )
    starts = np.concatenate(([0], np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1))
    if max_batch_pages:
        starts = np.union1d(starts, np.arange(0, num_pages, max_batch_pages))
    lengths = np.diff(starts, append=num_pages)
    np.testing.assert_array_equal(runs.host.src_starts.cpu().numpy(), src[starts])
    np.testing.assert_array_equal(runs.host.dst_starts.cpu().numpy(), dst[starts])
    np.testing.assert_array_equal(runs.host.lengths.cpu().numpy(), lengths)
    batch_starts = np.arange(0, num_pages, max_batch_pages or num_pages)
    expected_offsets = np.append(np.searchsorted(starts, batch_starts), len(starts))
    np.testing.assert_array_equal(runs.host.batch_run_offsets.cpu().numpy(), expected_offsets)

"""plan_transfer on every backend equals the independent reference on random inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pages_strategies import layouts, page_lists
from suite_support import list_batches

import gpu_planner as gp
from gpu_planner import reference

BATCH_LIMITS = [0, 1, 7, 1024]


def as_input(values: np.ndarray, device: torch.device, dtype: torch.dtype, strided: bool):
    """Tensor on `device`; `strided` makes it a non-contiguous view (every other element)."""
    tensor = torch.from_numpy(values).to(device=device, dtype=dtype)
    if not strided:
        return tensor
    spread = torch.full((2 * len(values),), -1, dtype=dtype, device=device)
    spread[::2] = tensor
    view = spread[::2]
    assert len(values) < 2 or not view.is_contiguous()
    return view


def expected_batches(pages: dict, layout: dict, max_batch_pages: int):
    return reference.plan_batches(
        pages["src"].tolist(),
        pages["dst"].tolist(),
        layout["src_ptrs"],
        layout["dst_ptrs"],
        layout["item_lens"],
        layout["dst_is_device"],
        pages["device"].tolist(),
        max_batch_pages,
    )


def plan(pages, layout, max_batch_pages, backend, device, dtype=torch.int64, strided=False):
    tensors = {name: as_input(values, device, dtype, strided) for name, values in pages.items()}
    return gp.plan_transfer(
        tensors["src"],
        tensors["dst"],
        gp.BufferLayout(**layout),
        dst_device_pages=tensors["device"],
        max_batch_pages=max_batch_pages,
        backend=backend,
    )


@given(
    pages=page_lists(),
    layout=layouts(),
    max_batch_pages=st.sampled_from(BATCH_LIMITS),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    strided=st.booleans(),
)
def test_plan_matches_reference(backend_device, pages, layout, max_batch_pages, dtype, strided):
    backend, device = backend_device
    result = plan(pages, layout, max_batch_pages, backend, device, dtype, strided)
    expected = expected_batches(pages, layout, max_batch_pages)
    assert list_batches(result) == expected
    rows = [row for srcs, dsts, lens in expected for row in zip(srcs, dsts, lens, strict=True)]
    assert result.num_descriptors == len(rows)
    assert [tuple(row) for row in result.descriptors.tolist()] == rows
    assert result.src_addrs.tolist() == [src for src, _, _ in rows]
    assert result.total_bytes == sum(length for _, _, length in rows)


@given(pages=page_lists(), layout=layouts(), max_batch_pages=st.sampled_from(BATCH_LIMITS))
def test_buffer_batches_partition_each_batch(backend_device, pages, layout, max_batch_pages):
    backend, device = backend_device
    result = plan(pages, layout, max_batch_pages, backend, device)
    pieces = list(result.pieces(per_buffer=True, lists=True))
    joined = [
        value for *_, srcs, dsts, lens in pieces for value in zip(srcs, dsts, lens, strict=True)
    ]
    assert joined == [value for batch in list_batches(result) for value in zip(*batch, strict=True)]
    grouped = {}
    for piece in pieces:
        grouped.setdefault(piece.batch, []).append(piece)
    assert [piece.batch for piece in pieces] == sorted(piece.batch for piece in pieces)
    regrouped = []
    for group in grouped.values():
        srcs, dsts, lens = [], [], []
        for piece in group:
            srcs, dsts, lens = srcs + piece.srcs, dsts + piece.dsts, lens + piece.lens
        regrouped.append((srcs, dsts, lens))
    assert regrouped == list_batches(result)
    for _, buffer, srcs, _, lens in pieces:
        item_len = layout["item_lens"][buffer]
        assert all(length % item_len == 0 for length in lens)
        assert all((src - layout["src_ptrs"][buffer]) % item_len == 0 for src in srcs)


@pytest.mark.parametrize("max_batch_pages", BATCH_LIMITS)
def test_batch_offsets_count_batches(backend_device, max_batch_pages):
    backend, device = backend_device
    rng = np.random.default_rng(max_batch_pages)
    num_pages = 3000
    pages = {name: rng.permutation(4 * num_pages)[:num_pages] for name in ("src", "dst", "device")}
    layout = {
        "src_ptrs": [2**47, 2**47 + 2**30],
        "dst_ptrs": [2**46, 2**46 + 2**30],
        "item_lens": [64, 128],
        "dst_is_device": [False, True],
    }
    result = plan(pages, layout, max_batch_pages, backend, device)
    step = max_batch_pages if 0 < max_batch_pages < num_pages else num_pages
    assert result.num_batches == -(-num_pages // step)
    offsets = result.batch_offsets.tolist()
    assert len(offsets) == result.num_batches + 1 and offsets[0] == 0
    sizes = [end - start for start, end in zip(offsets[:-1], offsets[1:], strict=True)]
    assert [len(batch[0]) for batch in list_batches(result)] == [size for size in sizes if size]
    assert list_batches(result) == expected_batches(pages, layout, max_batch_pages)


def test_empty_request_plans_nothing(backend_device):
    backend, device = backend_device
    empty = np.zeros(0, dtype=np.int64)
    layout = {"src_ptrs": [4096], "dst_ptrs": [8192], "item_lens": [16], "dst_is_device": [True]}
    result = plan({"src": empty, "dst": empty, "device": empty}, layout, 7, backend, device)
    assert result.num_batches == 0
    assert result.num_descriptors == 0
    assert list_batches(result) == []
    assert result.batch_offsets.tolist() == [0]


def test_numpy_inputs_match_tensor_inputs():
    rng = np.random.default_rng(3)
    src, dst = rng.permutation(500)[:200], rng.permutation(500)[:200].astype(np.int32)
    layout = gp.BufferLayout([2**40], [2**41], [256])
    from_numpy = gp.plan_transfer(src, dst, layout)
    from_torch = gp.plan_transfer(torch.from_numpy(src), torch.from_numpy(dst), layout)
    assert list_batches(from_numpy) == list_batches(from_torch)


def test_buffers_of_one_length_group_share_length_objects():
    # Buffers 0 and 1 share a space and an item length, so their lengths are the
    # same int objects (no allocation per descriptor); buffer 2's differ.
    src = np.array([10, 11, 12, 40, 41])
    dst = np.array([5, 6, 7, 8, 20])
    layout = gp.BufferLayout(
        [2**46, 2**46 + 2**30, 2**45], [2**47, 2**47 + 2**30, 2**44], [4096, 4096, 8192]
    )
    result = gp.plan_transfer(src, dst, layout)
    ((_, _, lens),) = list_batches(result)
    assert lens == [3 * 4096, 4096, 4096] * 2 + [3 * 8192, 8192, 8192]
    assert all(lens[run] is lens[3 + run] for run in range(3))
    first, second, third = result.pieces(per_buffer=True, lists=True)
    assert all(a is b for a, b in zip(first.lens, second.lens, strict=True))
    assert first.lens is not second.lens  # each piece owns its list
    assert third.lens == [3 * 8192, 8192, 8192]

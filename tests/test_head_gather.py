"""The head-slice gather against a plain-Python reference, end to end against sglang's send.

Each backend (the compiled CPU loop, the Triton kernel under the interpreter,
and on a GPU the kernel on CUDA) gathers real KV buffers; the reference copies
the same slices by array slicing, token by token, never through an address.
End to end, the gather plus its descriptors, applied as byte copies to fake
decode buffers, lands exactly what sglang's per-token descriptors land.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gpu_planner as gp
from gpu_planner import head_gather
from gpu_planner.head_gather import (
    HostRegion,
    chunk_layout,
    gather_head_slices,
    gathered_descriptors,
    staging_nbytes,
)
from gpu_planner.head_slices import HeadSliceLayout, head_slice_descriptors
from gpu_planner.kernels import interpreter_enabled
from gpu_planner.reference import group_runs

GUARD = 64  # bytes after the staged region that must stay as they were
FAKE_DECODE_BASE = 1 << 44  # decode buffers live at made-up addresses
FAKE_STAGING = 1 << 45


@dataclass(frozen=True)
class Geometry:
    """Per entry (a K or V buffer of a layer), the byte geometry of both sides."""

    page_size: int
    src_token_lens: list[int]
    src_head_offsets: list[int]
    dst_token_lens: list[int]
    dst_head_offsets: list[int]
    slice_lens: list[int]

    @property
    def num_entries(self) -> int:
        return len(self.slice_lens)


def head_slice_params(tp_prefill, tp_decode, rank_prefill, rank_decode, heads):
    """(src head start, heads sent, dst head start): sglang 0.5.23's compute_head_slice_params."""
    src_heads, dst_heads = max(1, heads // tp_prefill), max(1, heads // tp_decode)
    if tp_prefill > tp_decode:
        unique_head = rank_prefill // max(1, tp_prefill // heads)
        return 0, src_heads, (unique_head * src_heads) % dst_heads
    unique_head = rank_decode // max(1, tp_decode // heads)
    return (unique_head * dst_heads) % src_heads, dst_heads, 0


@st.composite
def sglang_geometries(draw, prefill_below_decode: bool = True) -> Geometry:
    """MHA KV of 1-3 layers (K then V per sglang) between two attention TP sizes and ranks."""
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    head_bytes = draw(st.sampled_from([1, 2, 3, 8, 16, 64, 256]))  # head dim x dtype bytes
    tp_low = draw(st.sampled_from([1, 2, 4]))
    tp_high = tp_low * draw(st.sampled_from([1, 2, 4]))  # replication when above heads
    tp_prefill, tp_decode = (tp_low, tp_high) if prefill_below_decode else (tp_high, tp_low)
    rank_prefill = draw(st.integers(0, tp_prefill - 1))
    rank_decode = draw(st.integers(0, tp_decode - 1))
    src_head, num_heads, dst_head = head_slice_params(
        tp_prefill, tp_decode, rank_prefill, rank_decode, heads
    )
    entries = 2 * draw(st.integers(1, 3))
    return Geometry(
        page_size=draw(st.sampled_from([1, 2, 3, 16])),
        src_token_lens=[max(1, heads // tp_prefill) * head_bytes] * entries,
        src_head_offsets=[src_head * head_bytes] * entries,
        dst_token_lens=[max(1, heads // tp_decode) * head_bytes] * entries,
        dst_head_offsets=[dst_head * head_bytes] * entries,
        slice_lens=[num_heads * head_bytes] * entries,
    )


@st.composite
def free_geometries(draw) -> Geometry:
    """Any slices inside their token slots, one size per entry (not only sglang's)."""
    entries = draw(st.integers(1, 4))
    columns = {name: [] for name in ("src_token", "src_head", "dst_token", "dst_head", "slice")}
    for _ in range(entries):
        slice_len = draw(st.integers(0, 40))
        for side in ("src", "dst"):
            offset = draw(st.integers(0, 24))
            columns[f"{side}_head"].append(offset)
            columns[f"{side}_token"].append(offset + slice_len + draw(st.integers(0, 24)))
        columns["slice"].append(slice_len)
    return Geometry(
        draw(st.integers(1, 5)),
        columns["src_token"],
        columns["src_head"],
        columns["dst_token"],
        columns["dst_head"],
        columns["slice"],
    )


@dataclass
class Prefill:
    """Real source buffers on a torch device, their host copies and the layout over them."""

    geometry: Geometry
    buffers: list[torch.Tensor]
    host: list[np.ndarray]
    layout: HeadSliceLayout

    @property
    def src_lens(self) -> list[int]:
        return [buffer.numel() for buffer in self.buffers]


def make_prefill(geometry: Geometry, num_src_pages: int, device: torch.device, seed: int):
    generator = torch.Generator().manual_seed(seed)
    src_page_lens = [geometry.page_size * token_len for token_len in geometry.src_token_lens]
    buffers = [
        torch.randint(0, 256, (num_src_pages * page_len,), dtype=torch.uint8, generator=generator)
        for page_len in src_page_lens
    ]
    buffers = [buffer.to(device) for buffer in buffers]
    dst_page_lens = [geometry.page_size * token_len for token_len in geometry.dst_token_lens]
    layout = HeadSliceLayout.build(
        src_ptrs=[buffer.data_ptr() for buffer in buffers],
        dst_ptrs=[FAKE_DECODE_BASE + (entry << 32) for entry in range(geometry.num_entries)],
        page_size=geometry.page_size,
        src_page_lens=src_page_lens,
        dst_page_lens=dst_page_lens,
        src_token_lens=geometry.src_token_lens,
        dst_token_lens=geometry.dst_token_lens,
        src_head_offsets=geometry.src_head_offsets,
        dst_head_offsets=geometry.dst_head_offsets,
        slice_lens=geometry.slice_lens,
    )
    return Prefill(geometry, buffers, [buffer.cpu().numpy() for buffer in buffers], layout)


def reference_staging(prefill: Prefill, entries: list[int], src_pages, initial: np.ndarray):
    """The staging bytes after a gather of `entries`: slice by slice from the host copies."""
    geometry, staging = prefill.geometry, initial.copy()
    page_size, start = geometry.page_size, 0
    for entry in entries:
        src_token, dst_token = geometry.src_token_lens[entry], geometry.dst_token_lens[entry]
        length = geometry.slice_lens[entry]
        for position, page in enumerate(int(page) for page in src_pages):
            for slot in range(page_size):
                source = (page * page_size + slot) * src_token + geometry.src_head_offsets[entry]
                staged = (position * page_size + slot) * dst_token
                staged += start + geometry.dst_head_offsets[entry]
                staging[staged : staged + length] = prefill.host[entry][source : source + length]
        start += len(src_pages) * page_size * dst_token
    return staging


@st.composite
def page_lists(draw, num_pages: int, capacity: int) -> np.ndarray:
    """`num_pages` distinct pages below `capacity`: one run, no runs, or shuffled."""
    kind = draw(st.sampled_from(["contiguous", "fragmented", "shuffled"]))
    if kind == "contiguous":
        first = draw(st.integers(0, capacity - num_pages))
        return np.arange(first, first + num_pages)
    if kind == "fragmented":  # every other page: no two consecutive
        return np.arange(num_pages) * 2 + draw(st.integers(0, capacity - 2 * num_pages + 1))
    return np.array(draw(st.permutations(range(capacity)))[:num_pages], dtype=np.int64)


def as_page_input(pages: np.ndarray, data, device: torch.device):
    """`pages` as int32/int64, NumPy or a (possibly strided) tensor on `device`."""
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    kind = data.draw(st.sampled_from(["numpy", "tensor", "strided"]))
    if kind == "numpy":
        return pages.astype(np.int32 if dtype == torch.int32 else np.int64)
    tensor = torch.from_numpy(pages.astype(np.int64)).to(dtype)
    if kind == "strided":
        tensor = torch.stack([tensor, -torch.ones_like(tensor)], dim=1).flatten()[::2]
    return tensor.to(device)


def new_staging(nbytes: int, misalign: int, device: torch.device, seed: int):
    """(staging of `nbytes` at `misalign` bytes past a 16-byte boundary, whole block with guard)."""
    generator = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (nbytes + GUARD + 32,), dtype=torch.uint8, generator=generator)
    block = block.to(device)
    start = (-block.data_ptr()) % 16 + misalign
    return block[start : start + nbytes], block


def gather_case(data, backend_device, geometry: Geometry, chunk=None):
    """Gather a drawn case on the backend; return (prefill, entries, pages, before, after)."""
    backend, device = backend_device
    num_pages = data.draw(st.integers(0, 5), label="num_pages")
    capacity = data.draw(st.integers(max(2 * num_pages, 1), 2 * num_pages + 3))
    pages = data.draw(page_lists(num_pages, capacity))
    prefill = make_prefill(geometry, capacity, device, seed=data.draw(st.integers(0, 99)))
    entries = list(range(geometry.num_entries)) if chunk is None else chunk
    layout = chunk_layout(prefill.layout, entries)
    misalign = data.draw(st.sampled_from([0, 1, 2, 4, 8]))
    staging, block = new_staging(staging_nbytes(layout, num_pages), misalign, device, seed=1)
    before = block.cpu().numpy().copy()
    src_lens = [prefill.src_lens[entry] for entry in entries]
    page_input = as_page_input(pages, data, device)
    if device.type == "cpu" and backend == "cpu" and data.draw(st.booleans()):
        staging = staging.numpy()  # a NumPy array, or the same bytes as a host region
        if data.draw(st.booleans()):
            staging = HostRegion(staging.ctypes.data, staging.size)
    gather_head_slices(layout, page_input, staging, src_lens, backend=backend)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return prefill, entries, pages, before, block.cpu().numpy(), staging_region(block, staging)


def staging_region(block: torch.Tensor, staging) -> slice:
    address = staging.address if isinstance(staging, HostRegion) else _address(staging)
    start = address - block.data_ptr()
    nbytes = staging.nbytes if isinstance(staging, HostRegion) else _size(staging)
    return slice(start, start + nbytes)


def _address(array) -> int:
    return array.data_ptr() if isinstance(array, torch.Tensor) else array.ctypes.data


def _size(array) -> int:
    return array.numel() if isinstance(array, torch.Tensor) else array.size


def check_against_reference(case) -> None:
    prefill, entries, pages, before, after, region = case
    expected = before.copy()
    expected[region] = reference_staging(prefill, entries, pages, before[region])
    np.testing.assert_array_equal(after, expected)


@given(data=st.data(), geometry=sglang_geometries() | sglang_geometries(False))
def test_gather_matches_reference_for_sglang_slices(backend_device, data, geometry):
    """KV heads, head sizes, page sizes, TP both ways with replication, rank pairs, pages."""
    check_against_reference(gather_case(data, backend_device, geometry))


@given(data=st.data(), geometry=free_geometries())
def test_gather_matches_reference_for_any_slices(backend_device, data, geometry):
    """A different slice per entry (lane blocks masked per entry); bytes around them kept."""
    check_against_reference(gather_case(data, backend_device, geometry))


@given(data=st.data(), geometry=sglang_geometries())
def test_gather_of_a_layer_chunk_writes_only_its_entries(backend_device, data, geometry):
    layers = geometry.num_entries // 2
    first = data.draw(st.integers(0, layers - 1))
    stop = data.draw(st.integers(first + 1, layers))
    chunk = [*range(first, stop), *range(layers + first, layers + stop)]  # K, then V
    check_against_reference(gather_case(data, backend_device, geometry, chunk))


@given(data=st.data(), geometry=sglang_geometries() | free_geometries())
def test_a_gather_in_parts_writes_a_growing_prefix_and_the_references_bytes(data, geometry):
    """After each part the staging holds the reference's bytes up to what the part yields, and
    its bytes past that as they were: the prefix can go on the wire before the next part."""
    num_pages = data.draw(st.integers(0, 5), label="num_pages")
    capacity = data.draw(st.integers(max(2 * num_pages, 1), 2 * num_pages + 3))
    pages = data.draw(page_lists(num_pages, capacity))
    prefill = make_prefill(geometry, capacity, torch.device("cpu"), data.draw(st.integers(0, 99)))
    parts = data.draw(st.integers(1, 2 * geometry.num_entries + 1), label="parts")
    nbytes = staging_nbytes(prefill.layout, num_pages)
    staging, block = new_staging(nbytes, data.draw(st.sampled_from([0, 1, 8])), "cpu", seed=2)
    before = block.numpy().copy()
    region = staging_region(block, staging)
    expected = before.copy()
    entries = list(range(geometry.num_entries))
    expected[region] = reference_staging(prefill, entries, pages, before[region])
    page_input = as_page_input(pages, data, torch.device("cpu"))
    written = []
    for end in head_gather.gather_in_parts(
        prefill.layout, page_input, staging, prefill.src_lens, parts
    ):
        written.append(end)
        upto = region.start + end
        np.testing.assert_array_equal(block.numpy()[:upto], expected[:upto])
        np.testing.assert_array_equal(block.numpy()[upto:], before[upto:])
    assert written == sorted(set(written))  # each part adds bytes
    assert written[-1:] == ([nbytes] if num_pages else [])
    assert len(written) <= min(parts, geometry.num_entries)
    if num_pages and parts >= 2 and geometry.num_entries >= 2:
        largest_entry = max(geometry.dst_token_lens) * geometry.page_size * num_pages
        assert len(written) >= 2 or largest_entry * 2 > nbytes  # cut near equal bytes


def test_a_gather_in_parts_refuses_before_its_first_part(kv):
    """Checked at the call, as `gather_head_slices`: nothing is written, even unstarted."""
    layout = kv_layout(kv)
    staging = np.full(staging_nbytes(layout, 2), 7, dtype=np.uint8)
    with pytest.raises(gp.PlanValidationError, match=r"^src_pages\[1\] = -2"):
        head_gather.gather_in_parts(layout, np.array([1, -2]), staging, 128, parts=2)
    for parts in (0, 1.5, "2"):
        with pytest.raises(gp.PlanValidationError, match=r"^parts: must be an integer >= 1"):
            head_gather.gather_in_parts(layout, np.array([1, 3]), staging, 128, parts=parts)
    assert (staging == 7).all()


class FakeMemory:
    """Address ranges backed by host arrays: descriptors applied as byte copies, bounds asserted."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.arrays: list[np.ndarray] = []

    def add(self, address: int, array: np.ndarray) -> None:
        index = bisect.bisect(self.starts, address)
        self.starts.insert(index, address)
        self.arrays.insert(index, array)

    def view(self, address: int, length: int) -> np.ndarray:
        index = bisect.bisect(self.starts, address) - 1
        offset = address - self.starts[index]
        assert index >= 0 and offset + length <= self.arrays[index].size, hex(address)
        return self.arrays[index][offset : offset + length]

    def apply(self, srcs, dsts, lens) -> None:
        for src, dst, length in zip(srcs.tolist(), dsts.tolist(), lens.tolist(), strict=True):
            self.view(dst, length)[:] = self.view(src, length)


@given(data=st.data(), geometry=sglang_geometries())
def test_gathered_send_lands_what_sglangs_per_token_send_lands(backend_device, data, geometry):
    """Prefill TP <= decode TP: same decode bytes, one descriptor per entry per dst run."""
    backend, device = backend_device
    layers = geometry.num_entries // 2
    first = data.draw(st.integers(0, layers - 1))
    chunk = [first, layers + first] if data.draw(st.booleans()) else list(range(2 * layers))
    prefill, entries, src_pages, _, after, region = gather_case(
        data, backend_device, geometry, chunk
    )
    layout = chunk_layout(prefill.layout, entries)
    num_pages = len(src_pages)
    dst_pages = data.draw(page_lists(num_pages, 2 * num_pages + 2))
    decode_len = (2 * num_pages + 2) * geometry.page_size * geometry.dst_token_lens[0]
    decode_initial = np.random.default_rng(7).integers(0, 256, decode_len, dtype=np.uint8)
    landed = []
    for gathered in (False, True):
        memory = FakeMemory()
        for entry, host in enumerate(prefill.host):
            memory.add(prefill.buffers[entry].data_ptr(), host)
        decode = [decode_initial.copy() for _ in entries]
        for position, entry in enumerate(entries):
            memory.add(int(prefill.layout.geometry[1, 0, entry]), decode[position])
        if gathered:
            staging_address = FAKE_STAGING  # the gathered bytes, at a made-up address
            memory.add(staging_address, after[region])
            on_device = torch.from_numpy(dst_pages).to(device)  # the kernels on CUDA
            dst_input = on_device if device.type == "cuda" else dst_pages
            columns = gathered_descriptors(layout, dst_input, staging_address, backend=backend)
            assert columns.dtype == np.int64 and columns.shape[0] == 3
            memory.apply(*columns)
            dst_runs = len(group_runs(range(num_pages), dst_pages.tolist()))
            equal_tp_runs = len(group_runs(src_pages.tolist(), dst_pages.tolist()))
            assert columns.shape[1] == len(entries) * dst_runs <= len(entries) * equal_tp_runs
        else:
            descriptors = head_slice_descriptors(layout, src_pages, dst_pages)
            for position in range(len(entries)):
                memory.apply(*descriptors.layer(position))
        landed.append(decode)
    for per_token, gathered in zip(*landed, strict=True):
        np.testing.assert_array_equal(gathered, per_token)


def test_descriptors_are_entry_major_runs_of_dst_pages():
    layout = one_entry_layout(page_size=2, entries=2)
    columns = gathered_descriptors(layout, np.array([7, 8, 3, 4, 5]), staging_address=1000)
    page_len = 2 * 8
    expected_srcs = [1000, 1000 + 2 * page_len]
    expected_srcs += [src + 5 * page_len for src in expected_srcs]
    dst_ptrs = layout.geometry[1, 0].tolist()
    assert columns.tolist() == [
        expected_srcs,
        [
            dst_ptrs[0] + 7 * page_len,
            dst_ptrs[0] + 3 * page_len,
            dst_ptrs[1] + 7 * page_len,
            dst_ptrs[1] + 3 * page_len,
        ],
        [2 * page_len, 3 * page_len, 2 * page_len, 3 * page_len],
    ]


def one_entry_layout(page_size: int = 2, entries: int = 1, **overrides) -> HeadSliceLayout:
    args = dict(
        src_ptrs=[1 << 20] * entries,
        dst_ptrs=[(1 << 30) + (entry << 20) for entry in range(entries)],
        page_size=page_size,
        src_page_lens=16 * page_size,
        dst_page_lens=8 * page_size,
        src_token_lens=16,
        dst_token_lens=8,
        src_head_offsets=8,
        dst_head_offsets=0,
        slice_lens=8,
    )
    return HeadSliceLayout.build(**(args | overrides))


def test_staging_nbytes_sums_every_entrys_pages():
    layout = one_entry_layout(entries=3, dst_page_lens=[16, 32, 48])
    assert staging_nbytes(layout, 5) == 5 * (16 + 32 + 48)
    assert staging_nbytes(layout, 0) == 0


def test_compile_kernels_runs_the_loop_on_no_pages():
    head_gather.compile_kernels()


# Refusals: each names the argument at fault, and nothing is written.


@pytest.fixture
def kv() -> np.ndarray:
    """4 source pages of 2 tokens of 16 bytes."""
    return np.arange(128, dtype=np.uint8)


def kv_layout(kv: np.ndarray, **overrides) -> HeadSliceLayout:
    return one_entry_layout(src_ptrs=[kv.ctypes.data], **overrides)


def refused(kv, message, pages=(1, 3), staging=None, src_lens=128, backend=None, **overrides):
    layout = kv_layout(kv, **overrides)
    if staging is None:
        staging = np.full(staging_nbytes(layout, len(pages)), 7, dtype=np.uint8)
    before = staging.copy() if isinstance(staging, np.ndarray) else None
    with pytest.raises(gp.PlanValidationError, match=message):
        gather_head_slices(layout, np.array(pages), staging, src_lens, backend=backend)
    if before is not None:
        np.testing.assert_array_equal(staging, before)


def test_a_chunk_of_no_entries_copies_nothing(kv):
    gather_head_slices(
        chunk_layout(kv_layout(kv), []), np.array([1, 3]), np.zeros(0, np.uint8), 128
    )


def test_refuses_a_negative_source_page(kv):
    refused(kv, r"^src_pages\[1\] = -2: page indices must be >= 0$", pages=(1, -2))


def test_refuses_a_page_past_the_registered_source(kv):
    # Page 3 ends at byte 64; its last slice ends at 3 * 32 + 16 + 8 + 8 = 128.
    refused(kv, r"^entry 0: page 4 \(src_pages\) reads up to byte 160 .* = 128$", pages=(0, 4))
    refused(kv, r"^entry 0: page 3 .* up to byte 128 .*src_lens\[0\] = 127$", src_lens=127)


def test_refuses_source_lengths_past_int64(kv):
    refused(kv, r"^src_lens\[0\] = 9223372036854775807: .* past 2\*\*63 - 1$", src_lens=2**63 - 1)
    refused(kv, r"^src_lens: has 2 values for 1 layers$", src_lens=[1, 2])
    refused(kv, r"^src_lens\[0\] = -1: must be in \[0, 2\*\*63\)$", src_lens=-1)


def test_refuses_slices_past_their_staged_page(kv):
    refused(
        kv,
        r"^entry 0: the head slice of token slot 1 ends at byte 17 of a 16-byte",
        dst_head_offsets=1,
    )


def test_refuses_small_staging(kv):
    refused(
        kv,
        r"^staging: has 31 bytes but entry 0 writes up to byte 32 of it \(2 staged pages of 16 "
        r"bytes, from byte 0\)$",
        staging=np.zeros(31, np.uint8),
    )


@pytest.mark.parametrize(
    "staging",
    [
        np.zeros(32, np.int8),
        np.zeros((2, 16), np.uint8),
        np.zeros(64, np.uint8)[::2],
        torch.zeros(32, dtype=torch.int32),
        torch.zeros(64, dtype=torch.uint8)[::2],
        [0] * 32,
    ],
    ids=["int8", "2-d", "strided", "tensor-int32", "tensor-strided", "list"],
)
def test_refuses_staging_of_the_wrong_kind(kv, staging):
    refused(kv, r"^staging: expected a 1-D contiguous uint8", staging=staging)


def test_refuses_read_only_staging(kv):
    staging = np.zeros(32, np.uint8)
    staging.flags.writeable = False
    refused(kv, r"^staging: expected .* got ndarray of dtype uint8", staging=staging)


@pytest.mark.parametrize(
    ("region", "message"),
    [
        (HostRegion(-1, 32), r"^staging.address: must be an integer in \[0, 2\*\*63\)"),
        (HostRegion(16, True), r"^staging.nbytes: must be an integer"),
        (HostRegion(2**63 - 8, 32), r"^staging: 32 bytes at 9223372036854775800 is not a host"),
        (HostRegion(0, 32), r"^staging: 32 bytes at 0 is not a host region$"),
    ],
)
def test_refuses_bad_host_regions(kv, region, message):
    refused(kv, message, staging=region)


def test_refuses_staging_over_a_source_buffer(kv):
    refused(
        kv,
        r"^staging: the 32 bytes written at \d+ overlap the source buffer of entry 0 \(128 bytes",
        staging=kv[96:],
    )


def test_refuses_what_is_not_a_layout(kv):
    staging = np.zeros(32, np.uint8)
    for call in (
        lambda: gather_head_slices({"page_size": 2}, np.array([0]), staging, 128),
        lambda: gathered_descriptors({"page_size": 2}, np.array([0]), 4096),
    ):
        with pytest.raises(gp.PlanValidationError, match=r"^layout: expected a HeadSliceLayout"):
            call()


def test_refuses_more_entries_than_the_kernels_grid_takes(kv):
    if interpreter_enabled():
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        pytest.skip("the Triton backend needs the interpreter or CUDA")
    layout = chunk_layout(kv_layout(kv), [0] * 65536)
    staging = torch.zeros(staging_nbytes(layout, 1), dtype=torch.uint8, device=device)
    with pytest.raises(gp.PlanValidationError, match=r"^layout: 65536 entries .* at most 65535$"):
        gather_head_slices(layout, np.array([0]), staging, 128, backend="triton")
    assert not staging.any()


def test_refuses_an_unknown_backend(kv):
    refused(kv, r"^backend: must be None, 'cpu' or 'triton'", backend="numba")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA staging")
def test_refuses_the_cpu_loop_on_cuda_staging(kv):
    staging = torch.zeros(32, dtype=torch.uint8, device="cuda")
    refused(
        kv,
        r"^backend='cpu': the compiled loop needs staging in host memory",
        staging=staging,
        backend="cpu",
    )


def test_refuses_bad_chunk_entries(kv):
    layout = one_entry_layout(entries=2)
    with pytest.raises(
        gp.PlanValidationError, match=r"^entries\[1\] = 2: must be an integer in \[0, 2\)$"
    ):
        chunk_layout(layout, [0, 2])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"dst_head_offsets": 8, "dst_token_lens": 16, "dst_page_lens": 32},
            "a 8-byte slice at offset 8 of each 16-byte token slot",
        ),
        ({"dst_page_lens": 24}, "2 slots in a 24-byte page"),
        ({"slice_lens": 0, "dst_token_lens": 0, "dst_page_lens": 0}, "a 0-byte slice"),
    ],
)
def test_descriptors_refuse_partial_pages(overrides, message):
    with pytest.raises(
        gp.PlanValidationError, match=rf"^entry 0: staged pages would not be whole .*{message}"
    ):
        gathered_descriptors(one_entry_layout(**overrides), np.array([0]), 4096)


@pytest.mark.parametrize(
    ("pages", "address", "message"),
    [
        ([0, -3], 4096, r"^dst_pages\[1\] = -3: page indices must be >= 0$"),
        ([0], -1, r"^staging_address: must be an integer in \[0, 2\*\*63\)"),
        ([0], True, r"^staging_address: must be an integer"),
        (
            [0, 1],
            2**63 - 16,
            r"^staging_address: .* \+ 32 staged bytes would end past 2\*\*63 - 1$",
        ),
        ([0], 4096, None),
    ],
)
def test_descriptors_refuse_bad_pages_and_addresses(pages, address, message):
    layout = one_entry_layout()
    if message is None:
        assert gathered_descriptors(layout, np.array(pages), address).shape == (3, 1)
        return
    with pytest.raises(gp.PlanValidationError, match=message):
        gathered_descriptors(layout, np.array(pages), address)


def test_descriptors_refuse_decode_pages_past_int64():
    layout = one_entry_layout(dst_ptrs=[2**63 - 64])
    with pytest.raises(gp.PlanValidationError):
        gathered_descriptors(layout, np.array([3]), 4096)

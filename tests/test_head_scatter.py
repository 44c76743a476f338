"""The head-slice scatter against a plain-Python reference; gather + scatter against sglang's send.

Each backend (the compiled CPU loop, the Triton kernel under the interpreter,
and on a GPU the kernel on CUDA) scatters staged bytes into real destination
buffers; the reference copies the same slices by array slicing, token by
token, from the test's own geometry, never through an address or the
module's code. Guard bytes around every destination buffer and the whole
staging block must stay as they were. End to end, a gather on the prefill
side then a scatter on the decode side lands what sglang's per-token send
lands, for prefill TP above and below decode TP.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_head_gather import head_slice_params, page_lists

import gpu_planner as gp
from gpu_planner import head_scatter
from gpu_planner.head_gather import chunk_layout, gather_head_slices, staging_nbytes
from gpu_planner.head_scatter import HostRegion, scatter_head_slices, scatter_layout
from gpu_planner.head_slices import HeadSliceLayout
from gpu_planner.kernels import interpreter_enabled

GUARD = 64  # bytes before and after every buffer that must stay as they were
SPACES = ("host", "device", "mixed")
MISALIGNMENTS = st.just(0) | st.integers(1, 7)  # half aligned (wide lanes), half bytes


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Per entry (a K or V buffer of a layer), the byte geometry of the staged and dst pages."""

    page_size: int
    staged_page_lens: list[int]
    staged_token_lens: list[int]
    staged_head_offsets: list[int]
    dst_page_lens: list[int]
    dst_token_lens: list[int]
    dst_head_offsets: list[int]
    slice_lens: list[int]
    staged_gaps: list[int]  # bytes of staging skipped before each entry's staged pages

    @property
    def num_entries(self) -> int:
        return len(self.slice_lens)

    def staged_starts(self, num_pages: int, base: int = 0) -> list[int]:
        starts, start = [], base
        for gap, page_len in zip(self.staged_gaps, self.staged_page_lens, strict=True):
            starts.append(start + gap)
            start += gap + num_pages * page_len
        return starts

    def staged_nbytes(self, num_pages: int) -> int:
        return sum(self.staged_gaps) + num_pages * sum(self.staged_page_lens)

    def layout(self, dst_ptrs: list[int], num_pages: int, base: int = 0) -> HeadSliceLayout:
        return HeadSliceLayout.build(
            src_ptrs=self.staged_starts(num_pages, base),
            dst_ptrs=dst_ptrs,
            page_size=self.page_size,
            src_page_lens=self.staged_page_lens,
            dst_page_lens=self.dst_page_lens,
            src_token_lens=self.staged_token_lens,
            dst_token_lens=self.dst_token_lens,
            src_head_offsets=self.staged_head_offsets,
            dst_head_offsets=self.dst_head_offsets,
            slice_lens=self.slice_lens,
        )


@st.composite
def free_geometries(draw) -> Geometry:
    """Any slices inside their token slots, one size per entry, pages padded, gaps between."""
    page_size = draw(st.integers(1, 5))
    columns: dict[str, list[int]] = {}
    for _ in range(draw(st.integers(1, 4))):
        slice_len = draw(st.integers(0, 40))
        columns.setdefault("slice", []).append(slice_len)
        for side in ("staged", "dst"):
            offset = draw(st.integers(0, 24))
            token_len = offset + slice_len + draw(st.integers(0, 24))
            columns.setdefault(f"{side}_head", []).append(offset)
            columns.setdefault(f"{side}_token", []).append(token_len)
            columns.setdefault(f"{side}_page", []).append(
                page_size * token_len + draw(st.integers(0, 8))
            )
        columns.setdefault("gap", []).append(draw(st.sampled_from([0, 0, 1, 8, 13])))
    return Geometry(
        page_size,
        columns["staged_page"],
        columns["staged_token"],
        columns["staged_head"],
        columns["dst_page"],
        columns["dst_token"],
        columns["dst_head"],
        columns["slice"],
        columns["gap"],
    )


@st.composite
def receive_geometries(draw) -> tuple[Geometry, int, int]:
    """(geometry, writers, writer): a decode rank's receive of one writer's whole-slice chunk.

    Head bytes of 16+ give 16-byte aligned copies (the vector path), odd ones byte lanes.
    """
    page_size = draw(st.sampled_from([1, 2, 3, 16]))
    writers = draw(st.sampled_from([1, 2, 4]))
    writer = draw(st.integers(0, writers - 1))
    slice_len = draw(st.sampled_from([1, 2, 3, 8, 16, 64, 256])) * draw(st.sampled_from([1, 2]))
    entries = 2 * draw(st.integers(1, 3))
    token_len = writers * slice_len
    return (
        Geometry(
            page_size=page_size,
            staged_page_lens=[page_size * slice_len] * entries,
            staged_token_lens=[slice_len] * entries,
            staged_head_offsets=[0] * entries,
            dst_page_lens=[page_size * token_len] * entries,
            dst_token_lens=[token_len] * entries,
            dst_head_offsets=[writer * slice_len] * entries,
            slice_lens=[slice_len] * entries,
            staged_gaps=[0] * entries,
        ),
        writers,
        writer,
    )


def reference_scatter(
    geometry, staged, dst_before, staged_starts, host_pages, device_pages, spaces
):
    """The destination buffers after the scatter: slice by slice, from the test's geometry."""
    out = [buffer.copy() for buffer in dst_before]
    page_size = geometry.page_size
    for entry in range(geometry.num_entries):
        pages = device_pages if spaces[entry] else host_pages
        length = geometry.slice_lens[entry]
        for position, page in enumerate(int(page) for page in pages):
            for slot in range(page_size):
                source = staged_starts[entry] + position * geometry.staged_page_lens[entry]
                source += slot * geometry.staged_token_lens[entry]
                source += geometry.staged_head_offsets[entry]
                target = (
                    page * geometry.dst_page_lens[entry] + slot * geometry.dst_token_lens[entry]
                )
                target += geometry.dst_head_offsets[entry]
                out[entry][target : target + length] = staged[source : source + length]
    return out


def page_input(pages: np.ndarray, data, device: torch.device):
    """`pages` as int32/int64: a NumPy array or tensor on `device`, contiguous or strided."""
    dtype = data.draw(st.sampled_from([np.int32, np.int64]))
    kind = data.draw(st.sampled_from(["numpy", "numpy-strided", "tensor", "tensor-strided"]))
    values = pages.astype(dtype)
    if kind.endswith("strided"):
        values = np.stack([values, -np.ones_like(values)], axis=1).reshape(-1)[::2]
    if kind.startswith("numpy"):
        return values
    return torch.from_numpy(values).to(device)


def guarded(nbytes: int, misalign: int, device: torch.device, seed: int):
    """(buffer of `nbytes` at `misalign` bytes past a 16-byte boundary, whole block with guards)."""
    generator = torch.Generator().manual_seed(seed)
    block = torch.randint(
        0, 256, (nbytes + 2 * GUARD + 32,), dtype=torch.uint8, generator=generator
    )
    block = block.to(device)
    start = GUARD + (-block.data_ptr()) % 16 + misalign
    return block[start : start + nbytes], block


def spaces_of(kind: str, num_entries: int, data) -> list[bool]:
    if kind == "host":
        return [False] * num_entries
    if kind == "device":
        return [True] * num_entries
    return data.draw(st.lists(st.booleans(), min_size=num_entries, max_size=num_entries))


@dataclasses.dataclass
class Case:
    """A drawn scatter: its inputs, and every block's bytes before it."""

    geometry: Geometry
    host_pages: np.ndarray
    device_pages: np.ndarray
    spaces: list[bool]
    buffers: list[torch.Tensor]  # the registered destination buffers
    blocks: list[torch.Tensor]  # those buffers with their guards
    staging: torch.Tensor
    staging_block: torch.Tensor
    before: list[np.ndarray]  # the destination blocks before
    staging_before: np.ndarray

    def check(self, staged_base: int = 0) -> None:
        """Every destination block as the reference has it; the staging untouched."""
        np.testing.assert_array_equal(self.staging_block.cpu().numpy(), self.staging_before)
        offsets = [
            buffer.data_ptr() - block.data_ptr()
            for buffer, block in zip(self.buffers, self.blocks, strict=True)
        ]
        views = [
            before[offset : offset + buffer.numel()]
            for before, offset, buffer in zip(self.before, offsets, self.buffers, strict=True)
        ]
        num_pages = len(self.host_pages)
        expected = reference_scatter(
            self.geometry,
            self.staging.cpu().numpy(),
            views,
            self.geometry.staged_starts(num_pages, staged_base),
            self.host_pages,
            self.device_pages,
            self.spaces,
        )
        for block, before, offset, view in zip(
            self.blocks, self.before, offsets, expected, strict=True
        ):
            whole = before.copy()
            whole[offset : offset + view.size] = view
            np.testing.assert_array_equal(block.cpu().numpy(), whole)


def scatter_case(data, backend_device, geometry: Geometry, spaces_kind: str) -> Case:
    """Scatter a drawn case on the backend; return it for `Case.check`."""
    backend, device = backend_device
    num_pages = data.draw(st.integers(0, 5), label="num_pages")
    spaces = spaces_of(spaces_kind, geometry.num_entries, data)
    host_capacity = data.draw(st.integers(max(2 * num_pages, 1), 2 * num_pages + 3))
    device_capacity = data.draw(st.integers(max(2 * num_pages, 1), 2 * num_pages + 3))
    host_pages = data.draw(page_lists(num_pages, host_capacity))
    device_pages = data.draw(page_lists(num_pages, device_capacity))
    buffers, blocks = [], []
    for entry in range(geometry.num_entries):
        capacity = device_capacity if spaces[entry] else host_capacity
        buffer, block = guarded(
            capacity * geometry.dst_page_lens[entry],
            data.draw(MISALIGNMENTS),
            device,
            seed=entry,
        )
        buffers.append(buffer)
        blocks.append(block)
    staging, staging_block = guarded(
        geometry.staged_nbytes(num_pages), data.draw(MISALIGNMENTS), device, seed=99
    )
    case = Case(
        geometry,
        host_pages,
        device_pages,
        spaces,
        buffers,
        blocks,
        staging,
        staging_block,
        [block.cpu().numpy().copy() for block in blocks],
        staging_block.cpu().numpy().copy(),
    )
    layout = geometry.layout([buffer.data_ptr() for buffer in buffers], num_pages)
    given_staging = staging
    if device.type == "cpu" and backend == "cpu" and data.draw(st.booleans()):
        given_staging = staging.numpy()  # a NumPy array, or the same bytes as a host region
        if data.draw(st.booleans()):
            given_staging = HostRegion(given_staging.ctypes.data, given_staging.size)
    uses_device = any(spaces)
    flags = spaces if data.draw(st.booleans()) else np.array(spaces)
    scatter_head_slices(
        layout,
        page_input(host_pages, data, device),
        given_staging,
        [buffer.numel() for buffer in buffers],
        dst_device_pages=page_input(device_pages, data, device) if uses_device else None,
        dst_is_device=flags if uses_device or data.draw(st.booleans()) else None,
        backend=backend,
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    return case


@given(data=st.data(), geometry=free_geometries(), spaces=st.sampled_from(SPACES))
def test_scatter_matches_reference_for_any_slices(backend_device, data, geometry, spaces):
    """A different slice per entry, padded pages, gaps in the staging; bytes around them kept."""
    scatter_case(data, backend_device, geometry, spaces).check()


@given(data=st.data(), drawn=receive_geometries(), spaces=st.sampled_from(SPACES))
def test_scatter_matches_reference_for_receive_layouts(backend_device, data, drawn, spaces):
    """Whole-slice chunks of one of `writers` writers: 16-byte vectors, wide lanes, bytes."""
    geometry, _, _ = drawn
    scatter_case(data, backend_device, geometry, spaces).check()


@pytest.mark.parametrize("spaces", SPACES)
@pytest.mark.parametrize(
    "host_pages",
    [[], [3], [2, 3, 4, 5], [7, 1, 4, 0]],
    ids=["empty", "single", "contiguous", "fragmented"],
)
def test_scatter_page_patterns(backend_device, host_pages, spaces):
    backend, device = backend_device
    geometry = Geometry(2, [16, 8], [8, 4], [0, 0], [40, 16], [16, 8], [8, 4], [8, 4], [0, 5])
    on_device = {"host": [False, False], "device": [True, True], "mixed": [False, True]}[spaces]
    host = np.array(host_pages, dtype=np.int64)
    device_pages = np.array([6, 5, 9, 8][: len(host)], dtype=np.int64)
    buffers = [torch.randint(0, 256, (10 * 40,), dtype=torch.uint8).to(device) for _ in range(2)]
    buffers[1] = buffers[1][: 10 * 16]
    staging = torch.randint(0, 256, (geometry.staged_nbytes(len(host)),), dtype=torch.uint8)
    staging = staging.to(device)
    before = [buffer.cpu().numpy().copy() for buffer in buffers]
    layout = geometry.layout([buffer.data_ptr() for buffer in buffers], len(host))
    scatter_head_slices(
        layout,
        host,
        staging,
        [buffer.numel() for buffer in buffers],
        dst_device_pages=torch.from_numpy(device_pages).to(device),
        dst_is_device=on_device,
        backend=backend,
    )
    expected = reference_scatter(
        geometry,
        staging.cpu().numpy(),
        before,
        geometry.staged_starts(len(host)),
        host,
        device_pages,
        on_device,
    )
    for buffer, want in zip(buffers, expected, strict=True):
        np.testing.assert_array_equal(buffer.cpu().numpy(), want)
    if host_pages:
        assert any(
            (buffer.cpu().numpy() != old).any() for buffer, old in zip(buffers, before, strict=True)
        )


@settings(max_examples=20)
@given(data=st.data(), drawn=receive_geometries())
def test_writers_fill_the_union_of_their_slices(backend_device, data, drawn):
    """TP-down: each writer's chunk (one staging region, one base per writer) into the same slots.

    The writers that scatter leave the other writers' head ranges as they were.
    """
    backend, device = backend_device
    geometry, writers, _ = drawn
    num_pages = data.draw(st.integers(1, 4))
    capacity = 2 * num_pages + 1
    pages = data.draw(page_lists(num_pages, capacity))
    entries = geometry.num_entries
    buffers = [
        torch.randint(0, 256, (capacity * geometry.dst_page_lens[0],), dtype=torch.uint8).to(device)
        for _ in range(entries)
    ]
    chunk = geometry.staged_nbytes(num_pages)
    staging = torch.randint(0, 256, (writers * chunk,), dtype=torch.uint8).to(device)
    expected = [buffer.cpu().numpy().copy() for buffer in buffers]
    scattering = data.draw(st.lists(st.integers(0, writers - 1), min_size=1, unique=True))
    for writer in scattering:
        layout = scatter_layout(
            [buffer.data_ptr() for buffer in buffers],
            geometry.dst_page_lens,
            geometry.page_size,
            writers,
            writer,
            staged_base=writer * chunk,
            num_pages=num_pages,
        )
        scatter_head_slices(layout, pages, staging, [b.numel() for b in buffers], backend=backend)
        writer_geometry = dataclasses.replace(
            geometry,
            dst_head_offsets=[writer * geometry.slice_lens[0]] * entries,
            staged_gaps=[writer * chunk] + [0] * (entries - 1),
        )
        expected = reference_scatter(
            writer_geometry,
            staging.cpu().numpy(),
            expected,
            writer_geometry.staged_starts(num_pages),
            pages,
            pages,
            [False] * entries,
        )
    for buffer, want in zip(buffers, expected, strict=True):
        np.testing.assert_array_equal(buffer.cpu().numpy(), want)


@settings(max_examples=25)
@given(
    data=st.data(),
    heads=st.sampled_from([1, 2, 4, 8]),
    head_bytes=st.sampled_from([1, 3, 16, 64]),
    tp=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4])),
)
def test_gather_then_scatter_lands_sglangs_per_token_send(
    backend_device, data, heads, head_bytes, tp
):
    """Prefill gathers its heads into staged whole slices; decode scatters them into its pages.

    Both TP directions and rank pairs, host/device decode spaces: the decode
    buffers hold what sglang's per-token descriptors write (`reference`).
    """
    backend, device = backend_device
    tp_prefill, tp_decode = tp
    rank_prefill = data.draw(st.integers(0, tp_prefill - 1))
    rank_decode = data.draw(st.integers(0, tp_decode - 1))
    src_head, num_heads, dst_head = head_slice_params(
        tp_prefill, tp_decode, rank_prefill, rank_decode, heads
    )
    page_size = data.draw(st.sampled_from([1, 2, 16]))
    src_token = max(1, heads // tp_prefill) * head_bytes
    dst_token = max(1, heads // tp_decode) * head_bytes
    slice_len = num_heads * head_bytes
    assert dst_token % slice_len == 0 and (dst_head * head_bytes) % slice_len == 0
    src_offset, dst_offset = src_head * head_bytes, dst_head * head_bytes
    entries = 2 * data.draw(st.integers(1, 2))
    num_pages = data.draw(st.integers(0, 4))
    capacity = 2 * num_pages + 2
    src_pages = data.draw(page_lists(num_pages, capacity))
    host_pages = data.draw(page_lists(num_pages, capacity))
    device_pages = data.draw(page_lists(num_pages, capacity))
    spaces = data.draw(st.lists(st.booleans(), min_size=entries, max_size=entries))

    def kv(token_len: int, seed: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        shape = (capacity * page_size * token_len,)
        return [
            torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator).to(device)
            for _ in range(entries)
        ]

    prefill, decode = kv(src_token, 1), kv(dst_token, 2)
    decode_before = [buffer.cpu().numpy().copy() for buffer in decode]
    # Prefill: gather into staging laid out as whole slices (the chunk RDMA carries).
    gather_layout = HeadSliceLayout.build(
        src_ptrs=[buffer.data_ptr() for buffer in prefill],
        dst_ptrs=[buffer.data_ptr() for buffer in decode],
        page_size=page_size,
        src_page_lens=page_size * src_token,
        dst_page_lens=page_size * slice_len,
        src_token_lens=src_token,
        dst_token_lens=slice_len,
        src_head_offsets=src_offset,
        dst_head_offsets=0,
        slice_lens=slice_len,
    )
    staging = torch.zeros(staging_nbytes(gather_layout, num_pages), dtype=torch.uint8)
    staging = staging.to(device)
    src_lens = [buffer.numel() for buffer in prefill]
    gather_head_slices(gather_layout, src_pages, staging, src_lens, backend=backend)
    # Decode: scatter the landed chunk; `writers` chunks of whole slices fill a slot.
    layout = scatter_layout(
        [buffer.data_ptr() for buffer in decode],
        page_size * dst_token,
        page_size,
        writers=dst_token // slice_len,
        writer=dst_offset // slice_len,
        num_pages=num_pages,
    )
    scatter_head_slices(
        layout,
        host_pages,
        staging,
        [buffer.numel() for buffer in decode],
        dst_device_pages=device_pages,
        dst_is_device=spaces,
        backend=backend,
    )
    for entry in range(entries):
        expected = decode_before[entry].copy()
        source = prefill[entry].cpu().numpy()
        pages = device_pages if spaces[entry] else host_pages
        for src_page, dst_page in zip(src_pages.tolist(), pages.tolist(), strict=True):
            for slot in range(page_size):  # sglang: one descriptor per token
                read = (src_page * page_size + slot) * src_token + src_offset
                write = (dst_page * page_size + slot) * dst_token + dst_offset
                expected[write : write + slice_len] = source[read : read + slice_len]
        np.testing.assert_array_equal(decode[entry].cpu().numpy(), expected)


def test_scatter_at_high_addresses_and_offsets_past_4_gib(backend_device):
    """int64 all the way: a buffer near 2**47 (where Linux maps large blocks), pages past 4 GiB.

    A 4.5 GiB host buffer from `np.zeros` is mapped, not touched: only the
    written pages become memory. On CUDA the buffer is real device memory.
    """
    backend, device = backend_device
    page_len, pages = 1 << 20, np.array([4500, 3, 4501], dtype=np.int64)
    nbytes = 4502 * page_len
    if device.type == "cuda":
        buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    else:
        buffer = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
    if buffer.data_ptr() < 1 << 40:
        pytest.skip(f"the buffer is at {buffer.data_ptr():#x}, not high in the address space")
    layout = scatter_layout(
        [buffer.data_ptr()], page_len, page_size=2, writers=4, writer=3, num_pages=3
    )
    staging = (torch.arange(3 * page_len // 4) % 251).to(torch.uint8).to(device)
    scatter_head_slices(layout, torch.from_numpy(pages), staging, nbytes, backend=backend)
    slot, quarter = page_len // 2, page_len // 8
    staged = staging.cpu().numpy()
    for position, page in enumerate(pages.tolist()):
        for token in range(2):
            start = page * page_len + token * slot
            written = buffer[start : start + slot].cpu().numpy()
            assert not written[: 3 * quarter].any()
            staged_slice = position * page_len // 4 + token * quarter
            np.testing.assert_array_equal(
                written[3 * quarter :], staged[staged_slice : staged_slice + quarter]
            )
        if page - 1 not in pages:  # the page before is untouched
            assert not buffer[page * page_len - 64 : page * page_len].cpu().numpy().any()


# scatter_layout


def test_scatter_layout_stages_entries_buffer_major_from_the_base():
    layout = scatter_layout([1 << 30, 1 << 31, 1 << 32], [64, 128, 32], 4, 2, 1, 100, num_pages=5)
    staged_page_lens = [32, 64, 16]
    assert layout.geometry[0].tolist() == [
        [100, 100 + 5 * 32, 100 + 5 * (32 + 64)],
        staged_page_lens,
        [8, 16, 4],
        [0, 0, 0],
    ]
    assert layout.geometry[1].tolist() == [
        [1 << 30, 1 << 31, 1 << 32],
        [64, 128, 32],
        [16, 32, 8],
        [8, 16, 4],
    ]
    assert layout.slice_lens.tolist() == [8, 16, 4]
    assert layout.page_size == 4


def test_scatter_layout_of_one_writer_moves_whole_pages():
    layout = scatter_layout([4096], 48, 3, num_pages=2)
    assert layout.geometry[:, :, 0].tolist() == [[0, 48, 16, 0], [4096, 48, 16, 0]]
    assert layout.slice_lens.tolist() == [16]


NOT_A_MULTIPLE = r"^entry 1: dst_page_lens\[1\] = 60 is not a multiple of page_size \* writers"
PAST_INT64 = r"^entry 1: its staged pages would start at byte 9223372036854775870 .* 2\*\*63 - 1$"


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (([0, 0], [64, 60], 4, 2), {}, NOT_A_MULTIPLE + r" = 4 \* 2$"),
        (
            ([0], 64, 4, 2, 2),
            {},
            r"^writer: must be an integer in \[0, 2\) \(writers = 2\), got 2$",
        ),
        (([0], 64, 4, 2, -1), {}, r"^writer: must be an integer in \[0, 2\)"),
        (([0], 64, 4, 0), {}, r"^writers: must be an integer in \[1, 2\*\*63\), got 0$"),
        (([0], 64, 4, 1, 0, -1), {}, r"^staged_base: must be an integer in \[0, 2\*\*63\)"),
        (([0], 64, 0), {}, r"^page_size: must be an integer >= 1"),
        (([0], 64, 4), {"num_pages": -1}, r"^num_pages: must be an integer >= 0, got -1$"),
        ((0, 64, 4), {}, r"^dst_ptrs: expected one address per entry, got 0$"),
        (([0, 0], [64, 64], 4, 1, 0, 2**63 - 2), {"num_pages": 1}, PAST_INT64),
    ],
)
def test_scatter_layout_refuses(args, kwargs, message):
    with pytest.raises(gp.PlanValidationError, match=message):
        scatter_layout(*args, **({"num_pages": 3} | kwargs))


def test_compile_kernels_runs_the_loop_on_no_pages():
    head_scatter.compile_kernels()


# Refusals: each names the argument at fault, and nothing is written.


@pytest.fixture
def kv() -> np.ndarray:
    """Two destination buffers (rows) of 4 pages of 2 token slots of 16 bytes."""
    return np.arange(256, dtype=np.uint8).reshape(2, 128)


def kv_layout(kv: np.ndarray, entries: int = 1, **overrides) -> HeadSliceLayout:
    """Each entry: staged pages of 2 slices of 8 bytes into the second half of each slot."""
    args = dict(
        src_ptrs=[16 * 2 * entry for entry in range(entries)],  # 2 staged pages an entry
        dst_ptrs=[kv[entry].ctypes.data for entry in range(entries)],
        page_size=2,
        src_page_lens=16,
        dst_page_lens=32,
        src_token_lens=8,
        dst_token_lens=16,
        src_head_offsets=0,
        dst_head_offsets=8,
        slice_lens=8,
    )
    return HeadSliceLayout.build(**(args | overrides))


def refused(
    kv,
    message,
    pages=(1, 3),
    staging=None,
    dst_lens=128,
    entries=1,
    backend=None,
    layout=None,
    **options,
):
    layout = kv_layout(kv, entries) if layout is None else layout
    if staging is None:
        staging = np.full(16 * 2 * entries, 7, dtype=np.uint8)
    kv_before = kv.copy()
    staging_before = staging.copy() if isinstance(staging, np.ndarray) else None
    with pytest.raises(gp.PlanValidationError, match=message):
        scatter_head_slices(layout, np.array(pages), staging, dst_lens, backend=backend, **options)
    np.testing.assert_array_equal(kv, kv_before)
    if staging_before is not None:
        np.testing.assert_array_equal(staging, staging_before)


def test_the_refusal_fixture_scatters_when_nothing_is_wrong(kv):
    staging = np.full(64, 7, dtype=np.uint8)
    layout = kv_layout(kv, entries=2)
    scatter_head_slices(
        layout, np.array([1, 3]), staging, 128, np.array([0, 2]), dst_is_device=[False, True]
    )
    expected = np.arange(256, dtype=np.uint8).reshape(2, 4, 2, 16)
    expected[0, [1, 3], :, 8:] = 7  # host pages 1 and 3, device pages 0 and 2
    expected[1, [0, 2], :, 8:] = 7
    np.testing.assert_array_equal(kv, expected.reshape(2, 128))


def test_a_layout_of_no_entries_copies_nothing(kv):
    layout = chunk_layout(kv_layout(kv), [])
    scatter_head_slices(layout, np.array([1, 3]), np.zeros(0, np.uint8), 128)


def test_refuses_negative_pages(kv):
    refused(kv, r"^dst_pages\[1\] = -2: page indices must be >= 0$", pages=(1, -2))
    refused(
        kv,
        r"^dst_device_pages\[0\] = -1: page indices must be >= 0$",
        entries=2,
        dst_device_pages=np.array([-1, 0]),
        dst_is_device=[False, True],
    )


def test_refuses_a_host_page_past_the_registered_destination(kv):
    # Page 4 starts at byte 128; its last slice ends at 4 * 32 + 16 + 8 + 8 = 160.
    refused(
        kv,
        r"^entry 0: page 4 \(dst_pages\) writes up to byte 160 of its destination buffer, but "
        r"dst_lens\[0\] = 128; the entry is host-backed: is the host page space right\?$",
        pages=(0, 4),
    )
    refused(kv, r"^entry 0: page 3 .* up to byte 128 .*dst_lens\[0\] = 127;", dst_lens=127)


def test_refuses_a_device_page_past_the_registered_destination(kv):
    refused(
        kv,
        r"^entry 1: page 7 \(dst_device_pages\) writes up to byte 256 .* dst_lens\[1\] = 128; "
        r"the entry is device-backed: is the device page space right\?$",
        entries=2,
        dst_device_pages=np.array([7, 0]),
        dst_is_device=[False, True],
    )


def test_refuses_reads_past_the_staging(kv):
    refused(
        kv,
        r"^staging: has 31 bytes but entry 0 reads up to byte 32 of it \(2 staged pages of 16 "
        r"bytes, from byte 0\)$",
        staging=np.zeros(31, np.uint8),
    )
    layout = kv_layout(kv, src_ptrs=[2**63 - 1])  # exact arithmetic: no wrap to a small offset
    refused(
        kv, r"^staging: has 32 bytes but entry 0 reads up to byte 922337203685477", layout=layout
    )


def test_refuses_staging_over_a_destination_buffer(kv):
    refused(
        kv,
        r"^staging: the 32 bytes read at \d+ overlap the destination buffer of entry 0 "
        r"\(128 bytes at \d+\)$",
        staging=kv[0, 96:],
    )


def test_refuses_destination_buffers_past_int64(kv):
    refused(
        kv,
        r"^dst_lens\[0\] = 9223372036854775807: the destination buffer at \d+ would end past "
        r"2\*\*63 - 1$",
        dst_lens=2**63 - 1,
    )
    refused(kv, r"^dst_lens: has 2 values for 1 layers$", dst_lens=[1, 2])
    refused(kv, r"^dst_lens\[0\] = -1: must be in \[0, 2\*\*63\)$", dst_lens=-1)


def test_bound_checks_use_exact_arithmetic(kv):
    """page * page_len = 2**70 would wrap in int64: the check sees the true end."""
    layout = kv_layout(kv, dst_ptrs=[2**62], dst_page_lens=2**40, dst_token_lens=2**39)
    refused(
        kv,
        r"^entry 0: page 1073741824 \(dst_pages\) writes up to byte "
        rf"{2**70 + 2**39 + 16} of its destination buffer, but dst_lens\[0\] = {2**62 - 1};",
        pages=(0, 2**30),
        layout=layout,
        dst_lens=2**62 - 1,
    )


def test_refuses_slices_past_their_destination_page(kv):
    layout = kv_layout(kv, dst_head_offsets=9)
    refused(
        kv,
        r"^entry 0: the head slice of token slot 1 ends at byte 33 of a 32-byte destination page",
        layout=layout,
    )


def test_refuses_missing_or_short_device_pages(kv):
    refused(
        kv,
        r"^dst_device_pages: missing, but entry 1 is device-backed \(dst_is_device\[1\] = True\)$",
        entries=2,
        dst_is_device=[False, True],
    )
    refused(
        kv,
        r"^dst_device_pages: has 3 pages but dst_pages has 2; ",
        entries=2,
        dst_device_pages=np.array([0, 1, 2]),
        dst_is_device=[False, True],
    )
    refused(
        kv,
        r"^dst_device_pages: expected an integer array, got dtype float64$",
        entries=2,
        dst_device_pages=np.array([0.0, 1.0]),
        dst_is_device=[False, True],
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([True], r"^dst_is_device: has 1 values for 2 entries$"),
        ([False, True, True], r"^dst_is_device: has 3 values for 2 entries$"),
        ([0, 2], r"^dst_is_device\[1\] = 2: must be True/False \(or 1/0\)$"),
        (np.array([0.0, 1.0]), r"^dst_is_device: expected one bool per entry, got float64"),
        (np.zeros((2, 1), bool), r"^dst_is_device: expected one bool per entry, got bool of shape"),
    ],
)
def test_refuses_bad_space_flags(kv, flags, message):
    refused(kv, message, entries=2, dst_device_pages=np.array([0, 1]), dst_is_device=flags)


@pytest.mark.parametrize(
    "staging",
    [
        np.zeros(32, np.int8),
        np.zeros((2, 16), np.uint8),
        torch.zeros(64, dtype=torch.uint8)[::2],
        HostRegion(0, 32),
    ],
    ids=["int8", "2-d", "tensor-strided", "null-region"],
)
def test_refuses_staging_of_the_wrong_kind(kv, staging):
    refused(
        kv, r"^staging: (expected a 1-D contiguous uint8|32 bytes at 0 is not)", staging=staging
    )


def test_refuses_what_is_not_a_layout(kv):
    with pytest.raises(gp.PlanValidationError, match=r"^layout: expected a HeadSliceLayout"):
        scatter_head_slices({"page_size": 2}, np.array([0]), np.zeros(32, np.uint8), 128)


def test_refuses_more_entries_than_the_kernels_grid_takes(kv):
    if interpreter_enabled():
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        pytest.skip("the Triton backend needs the interpreter or CUDA")
    layout = chunk_layout(kv_layout(kv), [0] * 65536)
    staging = torch.zeros(32, dtype=torch.uint8, device=device)
    kv_before = kv.copy()
    with pytest.raises(gp.PlanValidationError, match=r"^layout: 65536 entries .* at most 65535$"):
        scatter_head_slices(layout, np.array([0]), staging, 128, backend="triton")
    np.testing.assert_array_equal(kv, kv_before)


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

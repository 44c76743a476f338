"""Per-token descriptors of head-sliced KV sends, built in one compiled pass without the GIL.

When prefill and decode shard KV heads over different attention TP sizes, the
heads one side sends sit at a different offset of each token slot on the
other side, so nothing merges across tokens: sglang (`send_kvcache_slice`,
`_send_swa_state_slice`) sends one descriptor per token, per K/V buffer, per
layer, built with NumPy and `.tolist()`. Here every layer's `(src, dst, len)`
columns are written by one Numba loop, in sglang's order (page by page, each
page's token slots in order). Token `t` of page `p` in a layer starts at
`ptr + p * page_len + t * token_len + head_offset` on each side.

Safety as in the planner: every argument is checked before anything is
written, and every descriptor lies in [0, 2**63) (it ends at or below
2**63 - 1, checked without overflow), else a `PlanValidationError` names the
layer and token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpu_planner.errors import PlanValidationError
from gpu_planner.inputs import (
    INT64_MAX,
    IndexLike,
    as_host_array,
    as_page_list,
    check_page_size,
    check_same_length,
    is_integer,
    negative_page_error,
    shown_int,
)
from gpu_planner.jit import compiled

SIDES = ("src", "dst")
# Rows of a side's geometry table, one value per layer.
FIELDS = ("ptrs", "page_lens", "token_lens", "head_offsets")
_NO_OVERFLOW = -1

PerLayer = int | Sequence[int] | np.ndarray  # one value for every layer, or one per layer


def per_layer(values: PerLayer, name: str, num_layers: int) -> np.ndarray:
    """`values` as int64 [num_layers], each in [0, 2**63); the error names the layer."""
    if is_integer(values) and 0 <= values <= INT64_MAX:
        return np.full(num_layers, values, dtype=np.int64)
    checked = _checked_at_once(values, num_layers)
    if checked is not None:
        return checked
    if is_integer(values):
        values = [values] * num_layers
    try:
        listed = list(values)
    except TypeError:
        raise PlanValidationError(
            f"{name}: expected an integer or one integer per layer, got {values!r}"
        ) from None
    if len(listed) != num_layers:
        raise PlanValidationError(f"{name}: has {len(listed)} values for {num_layers} layers")
    for layer, value in enumerate(listed):
        if not is_integer(value):
            raise PlanValidationError(f"{name}[{layer}] = {value!r}: must be an integer")
        if not 0 <= int(value) <= INT64_MAX:
            shown = shown_int(int(value))
            raise PlanValidationError(f"{name}[{layer}] = {shown}: must be in [0, 2**63)")
    return np.array([int(value) for value in listed], dtype=np.int64)


def _checked_at_once(values: object, num_layers: int) -> np.ndarray | None:
    """`per_layer`'s answer for a list or tuple of Python ints or a 1-D integer array, checked
    with array operations (a send's layouts take ~20 layers' values each); None: anything
    else, or anything wrong, which `per_layer`'s loop then names."""
    if isinstance(values, (list, tuple)):
        if len(values) != num_layers or not set(map(type, values)) <= {int}:
            return None  # bool, NumPy scalars, anything else: the loop tells them apart
        try:
            values = np.array(values, dtype=np.int64)
        except OverflowError:
            return None
    elif not (isinstance(values, np.ndarray) and values.dtype.kind in "iu"):
        return None
    if values.shape != (num_layers,):
        return None
    if num_layers and (values.min() < 0 or values.max() > INT64_MAX):
        return None
    return values.astype(np.int64)


@dataclass(frozen=True)
class HeadSliceLayout:
    """Where each layer's sent heads sit on both sides, and how many bytes each token sends.

    Per side and layer: the buffer's base address (`*_ptrs`), the bytes of one
    page (`*_page_lens`, sglang's item_len), of one token slot (`*_token_lens`)
    and the offset of the first sent head in a slot (`*_head_offsets`);
    `slice_lens` is the bytes each token sends. An int stands for every layer.

    Example:
        >>> layout = HeadSliceLayout.build(
        ...     src_ptrs=[4096, 8192], dst_ptrs=[65536, 131072], page_size=2,
        ...     src_page_lens=64, dst_page_lens=32, src_token_lens=32, dst_token_lens=16,
        ...     src_head_offsets=16, dst_head_offsets=0, slice_lens=16)
        >>> layout.num_layers
        2
    """

    geometry: np.ndarray  # int64 [2 sides, 4 FIELDS, layers]
    slice_lens: np.ndarray  # int64 [layers]
    page_size: int

    @classmethod
    def build(
        cls,
        *,
        src_ptrs: Sequence[int],
        dst_ptrs: Sequence[int],
        page_size: int,
        src_page_lens: PerLayer,
        dst_page_lens: PerLayer,
        src_token_lens: PerLayer,
        dst_token_lens: PerLayer,
        src_head_offsets: PerLayer,
        dst_head_offsets: PerLayer,
        slice_lens: PerLayer,
    ) -> HeadSliceLayout:
        """Check every value (integers in [0, 2**63), one per layer) and stack them."""
        given = {
            "src": (src_ptrs, src_page_lens, src_token_lens, src_head_offsets),
            "dst": (dst_ptrs, dst_page_lens, dst_token_lens, dst_head_offsets),
        }
        num_layers = len(src_ptrs)
        geometry = np.stack(
            [
                np.stack(
                    [
                        per_layer(values, f"{side}_{field}", num_layers)
                        for field, values in zip(FIELDS, given[side], strict=True)
                    ]
                )
                for side in SIDES
            ]
        ).reshape(2, len(FIELDS), num_layers)
        return cls(
            geometry, per_layer(slice_lens, "slice_lens", num_layers), check_page_size(page_size)
        )

    @property
    def num_layers(self) -> int:
        return self.slice_lens.shape[0]


@dataclass(frozen=True)
class HeadSliceDescriptors:
    """Every layer's per-token descriptors.

    `addresses` int64 [2, layers, tokens] holds the source, then the destination
    addresses; every token of a layer sends the same length, so layers of one
    length share one read-only lengths column (`lens_columns`, by length).
    """

    addresses: np.ndarray
    slice_lens: np.ndarray  # int64 [layers]
    lens_columns: dict[int, np.ndarray]

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Layer `layer`'s (srcs, dsts, lens): contiguous int64 arrays, in sglang's order."""
        lens = self.lens_columns[int(self.slice_lens[layer])]
        return self.addresses[0, layer], self.addresses[1, layer], lens

    @property
    def num_tokens(self) -> int:
        """Descriptors per layer: pages * page_size."""
        return self.addresses.shape[2]


@compiled
def _room_after(room, count, step):
    """`room - count * step` when it is >= 0 (checked without overflow), else -1."""
    if step and count > room // step:
        return -1
    return room - count * step


@compiled
def _fits(geometry, slice_lens, side, layer, page, slot):
    """Whether this token's descriptor ends at or below 2**63 - 1 (no sum can overflow)."""
    room = 9223372036854775807 - geometry[side, 0, layer]
    room = _room_after(room, page, geometry[side, 1, layer])
    if room >= 0:
        room = _room_after(room, slot, geometry[side, 2, layer])
    if room >= 0:
        room = _room_after(room, 1, geometry[side, 3, layer])
    if room >= 0:
        room = _room_after(room, 1, slice_lens[layer])
    return room >= 0


@compiled
def _write_addresses(geometry, slice_lens, pages, page_size, addresses, overflow):
    """Fill `addresses` [2, layers, pages * page_size]; or stop at the first overflow.

    `pages` [2, n] holds the source, then the destination pages (all >= 0).
    Each side's largest descriptor is the last slot of its largest page: when
    it fits, all do; else `overflow` gets (layer, token, side) of the first
    descriptor, in sglang's order, that does not fit, and nothing is written.
    """
    num_pages = pages.shape[1]
    if num_pages == 0:
        return
    largest = (pages[0].max(), pages[1].max())
    for layer in range(slice_lens.shape[0]):
        for side in range(2):
            if not _fits(geometry, slice_lens, side, layer, largest[side], page_size - 1):
                for token in range(num_pages * page_size):
                    for check_side in range(2):
                        page = pages[check_side, token // page_size]
                        if not _fits(
                            geometry, slice_lens, check_side, layer, page, token % page_size
                        ):
                            overflow[0] = layer
                            overflow[1] = token
                            overflow[2] = check_side
                            return
    for layer in range(slice_lens.shape[0]):
        for side in range(2):
            out = addresses[side, layer]
            base = geometry[side, 0, layer] + geometry[side, 3, layer]
            page_len = geometry[side, 1, layer]
            token_len = geometry[side, 2, layer]
            side_pages = pages[side]
            for position in range(num_pages):
                page_base = base + side_pages[position] * page_len
                first = position * page_size
                for slot in range(page_size):
                    out[first + slot] = page_base + slot * token_len


def head_slice_descriptors(
    layout: HeadSliceLayout,
    src_pages: IndexLike,
    dst_pages: IndexLike,
    out: np.ndarray | None = None,
) -> HeadSliceDescriptors:
    """Every layer's per-token descriptors for pages `src_pages[i]` -> `dst_pages[i]`.

    Args:
        layout: the per-layer geometry (`HeadSliceLayout.build`).
        src_pages, dst_pages: 1-D int32/int64 page indices (NumPy or tensor), equal lengths.
        out: where to write the addresses: a C-contiguous int64 array of at least
            2 * layers * pages * page_size values (its first ones are used), or
            None for a new one. A reused block spares the page faults of fresh memory.

    Returns:
        `HeadSliceDescriptors`: per layer, token `t` of page position `i` is
        descriptor `i * page_size + t`.

    Raises:
        PlanValidationError: a negative page, unequal lengths, or a descriptor
            that would pass 2**63 - 1 (naming its layer, token and side).

    Example:
        >>> layout = HeadSliceLayout.build(
        ...     src_ptrs=[1000], dst_ptrs=[5000], page_size=2, src_page_lens=8,
        ...     dst_page_lens=4, src_token_lens=4, dst_token_lens=2,
        ...     src_head_offsets=2, dst_head_offsets=0, slice_lens=2)
        >>> head_slice_descriptors(layout, np.array([3]), np.array([1])).layer(0)
        (array([1026, 1030]), array([5004, 5006]), array([2, 2]))
    """
    names = ("src_pages", "dst_pages")
    page_lists = [
        as_host_array(as_page_list(pages, name))
        for pages, name in zip((src_pages, dst_pages), names, strict=True)
    ]
    check_same_length(page_lists[0], names[0], page_lists[1], names[1])
    pages = np.empty((2, len(page_lists[0])), dtype=np.int64)
    for row, values, name in zip(pages, page_lists, names, strict=True):
        row[:] = values
        negative = np.flatnonzero(row < 0)
        if negative.size:
            raise negative_page_error(name, int(negative[0]), int(row[negative[0]]))
    num_tokens = pages.shape[1] * layout.page_size
    addresses = _address_block(out, (2, layout.num_layers, num_tokens))
    overflow = np.full(3, _NO_OVERFLOW, dtype=np.int64)
    _write_addresses(
        layout.geometry, layout.slice_lens, pages, layout.page_size, addresses, overflow
    )
    if overflow[0] != _NO_OVERFLOW:
        layer, token, side = (int(value) for value in overflow)
        position, slot = divmod(token, layout.page_size)
        raise PlanValidationError(
            f"layer {layer}, token {token} (page {int(pages[side, position])} at "
            f"{names[side]}[{position}], slot {slot}): the {SIDES[side]} descriptor would "
            "end past 2**63 - 1"
        )
    lens_columns = {}
    for length in np.unique(layout.slice_lens).tolist():
        lens_columns[length] = np.full(num_tokens, length, dtype=np.int64)
        lens_columns[length].flags.writeable = False
    return HeadSliceDescriptors(addresses, layout.slice_lens, lens_columns)


def _address_block(out: np.ndarray | None, shape: tuple[int, int, int]) -> np.ndarray:
    """`shape` int64 addresses: new, or a view of the first values of `out`."""
    if out is None:
        return np.empty(shape, dtype=np.int64)
    size = shape[0] * shape[1] * shape[2]
    if not (
        isinstance(out, np.ndarray)
        and out.dtype == np.int64
        and out.flags.c_contiguous
        and out.flags.writeable
        and out.size >= size
    ):
        raise PlanValidationError(
            f"out: expected a writable C-contiguous int64 array of at least {size} values"
        )
    return out.reshape(-1)[:size].reshape(shape)


def compile_kernels() -> None:
    """Compile the loop now (or load it from Numba's cache), so no send waits for it."""
    layout = HeadSliceLayout.build(
        src_ptrs=[0],
        dst_ptrs=[0],
        page_size=1,
        src_page_lens=1,
        dst_page_lens=1,
        src_token_lens=1,
        dst_token_lens=1,
        src_head_offsets=0,
        dst_head_offsets=0,
        slice_lens=1,
    )
    pages = np.zeros(1, dtype=np.int64)
    head_slice_descriptors(layout, pages, pages)

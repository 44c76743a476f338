"""Per-peer buffer layout: pointers, item lengths and destination spaces, built once."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from gpu_planner.cuda_streams import copy_tables_to_device
from gpu_planner.errors import BoundsError, PlanValidationError
from gpu_planner.inputs import INT64_MAX, shown_int

HOST_SPACE = 0
DEVICE_SPACE = 1


def _as_int64(
    values: Sequence[int] | np.ndarray | torch.Tensor, name: str, *, flags: bool = False
) -> np.ndarray:
    """`values` as a flat int64 array; refuse non-integers and values outside int64.

    Booleans are refused unless `flags`: True is no address or length, and
    NumPy would quietly turn `[16, True]` into `[16, 1]`.
    """
    if isinstance(values, torch.Tensor):
        values = values.cpu().numpy()
    array = np.asarray(values)
    if array.ndim != 1:
        raise PlanValidationError(f"{name}: expected a flat list, got shape {array.shape}")
    if not flags:
        _refuse_bools(values, array, name)
    if array.dtype.kind in "ib" or (array.dtype.kind == "u" and array.itemsize < 8):
        return array.astype(np.int64)
    # uint64 data, or Python ints NumPy could not hold as int64: values >= 2**63 make
    # a list uint64, float64 (mixed with negatives) or object. Check them one by one.
    if array.dtype.kind == "u" or array.dtype == object:
        return _checked_ints(array.tolist(), name)
    if array.dtype.kind == "f" and not isinstance(values, np.ndarray):
        return _checked_ints(values, name)
    raise PlanValidationError(f"{name}: expected integers, got dtype {array.dtype}")


def _refuse_bools(values: Sequence[int] | np.ndarray, array: np.ndarray, name: str) -> None:
    """Raise naming `name` when `values` (converted to `array`) holds booleans."""
    if array.dtype.kind == "b":
        raise PlanValidationError(f"{name}: expected integers, got booleans (dtype {array.dtype})")
    if array.dtype == object or not isinstance(values, np.ndarray):  # bools became ints
        for position, value in enumerate(values):
            if isinstance(value, (bool, np.bool_)):
                raise PlanValidationError(
                    f"{name}[{position}] = {value!r}: expected an integer, not a bool"
                )


def _checked_ints(values: Sequence, name: str) -> np.ndarray:
    """Python-level check of each value: an integer that fits in int64, named on failure."""
    checked = []
    for position, value in enumerate(values):
        try:
            value = operator.index(value)
        except TypeError:
            raise PlanValidationError(
                f"{name}[{position}] = {value!r}: expected an integer"
            ) from None
        if not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise PlanValidationError(
                f"{name}[{position}] = {shown_int(value)}: does not fit in int64 (addresses and "
                "lengths must be below 2**63)"
            )
        checked.append(value)
    return np.array(checked, dtype=np.int64)


class BufferLayout:
    """The buffers of one prefill/decode peer pair, in layout (descriptor) order; build once.

    Args (one entry per buffer each; lists, NumPy arrays or tensors of integers):
        src_ptrs: source (prefill) base addresses.
        dst_ptrs: destination (decode) base addresses.
        item_lens: bytes per page (>= 1).
        dst_is_device: per buffer, whether its destination pages are in the
            device page space (`dst_device_pages`) instead of the host page
            space (`dst_pages`); default all host.
        src_lens, dst_lens: registered byte lengths; every descriptor is then
            checked to stay inside its buffer. Without them every descriptor
            must still end at or below address 2**63 - 1 (no address wraps).

    Example:
        >>> layout = gp.BufferLayout(
        ...     src_ptrs=[0x1000_0000, 0x2000_0000], dst_ptrs=[0x7000_0000, 0x8000_0000],
        ...     item_lens=[4096, 4096], dst_is_device=[False, True],
        ...     dst_lens=[4096 * 1024, 4096 * 256],
        ... )
    """

    def __init__(
        self,
        src_ptrs: Sequence[int] | np.ndarray | torch.Tensor,
        dst_ptrs: Sequence[int] | np.ndarray | torch.Tensor,
        item_lens: Sequence[int] | np.ndarray | torch.Tensor,
        dst_is_device: Sequence[bool] | np.ndarray | torch.Tensor | None = None,
        src_lens: Sequence[int] | np.ndarray | torch.Tensor | None = None,
        dst_lens: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    ) -> None:
        self.src_ptrs = _as_int64(src_ptrs, "src_ptrs")
        self.dst_ptrs = _as_int64(dst_ptrs, "dst_ptrs")
        self.item_lens = _as_int64(item_lens, "item_lens")
        self.num_buffers = len(self.src_ptrs)
        self._check_length("dst_ptrs", self.dst_ptrs)
        self._check_length("item_lens", self.item_lens)
        if dst_is_device is None:
            self.dst_is_device = np.zeros(self.num_buffers, dtype=bool)
        else:
            self.dst_is_device = _as_int64(dst_is_device, "dst_is_device", flags=True).astype(bool)
            self._check_length("dst_is_device", self.dst_is_device)
        self.src_lens = None if src_lens is None else _as_int64(src_lens, "src_lens")
        self.dst_lens = None if dst_lens is None else _as_int64(dst_lens, "dst_lens")
        for name in ("src_lens", "dst_lens"):
            if getattr(self, name) is not None:
                self._check_length(name, getattr(self, name))
        self._check_values()

        self.space = self.dst_is_device.astype(np.int32)
        # Buffers of each space that precede buffer b: its offset inside a batch is
        # host_before[b] * host_runs + device_before[b] * device_runs.
        is_device = self.dst_is_device.astype(np.int64)
        self.device_before = np.cumsum(is_device) - is_device
        self.host_before = np.arange(self.num_buffers, dtype=np.int64) - self.device_before
        self.num_device_buffers = int(is_device.sum())
        self.num_host_buffers = self.num_buffers - self.num_device_buffers
        # Per destination space: its buffers in layout order.
        self.space_buffers = [np.flatnonzero(self.space == space) for space in (0, 1)]
        # The per-buffer facts as Python ints, for the list hand-off's loops.
        self.buffer_spaces: list[int] = self.space.tolist()
        self.buffers_before: list[tuple[int, int]] = list(
            zip(self.host_before.tolist(), self.device_before.tolist(), strict=True)
        )
        # Buffers with one destination space and item length have equal lengths in
        # every batch: `length_groups[b]` numbers b's group, `length_group_leaders`
        # holds each group's first buffer.
        keys = list(zip(self.buffer_spaces, self.item_lens.tolist(), strict=True))
        leaders: dict[tuple[int, int], int] = {}
        for buffer, key in enumerate(keys):
            leaders.setdefault(key, buffer)
        group_of = {key: group for group, key in enumerate(leaders)}
        self.length_group_leaders = list(leaders.values())
        self.length_groups = [group_of[key] for key in keys]
        # Per side, the bytes past each buffer's pointer that a descriptor may reach:
        # its registered length, else the rest of the int64 address space.
        self._byte_limits = {
            side: INT64_MAX - ptrs if lens is None else lens
            for side, ptrs, lens in (
                ("src", self.src_ptrs, self.src_lens),
                ("dst", self.dst_ptrs, self.dst_lens),
            )
        }
        self._tables_by_torch_device: dict[torch.device, dict[str, torch.Tensor]] = {}

    def first_device_buffer(self) -> int | None:
        return int(self.space_buffers[DEVICE_SPACE][0]) if self.num_device_buffers else None

    def byte_limits(self, side: str) -> np.ndarray:
        """Per buffer, the bytes past its `side` pointer a descriptor may reach (int64).

        The registered length (`src_lens`/`dst_lens`) when given, else the rest of
        the int64 address space: every descriptor ends at or below 2**63 - 1. A
        descriptor over pages [start, last] fits when `last < limit // item_len`,
        a comparison that cannot overflow.
        """
        return self._byte_limits[side]

    def bounds_error(
        self, buffer: int, side: str, page_start: int, num_pages: int
    ) -> PlanValidationError:
        """The error for `buffer`'s descriptor over pages [page_start, +num_pages) on `side`.

        A `BoundsError` when it passes the registered length, else a
        `PlanValidationError`: it passes the end of the int64 address space.
        """
        item_len = int(self.item_lens[buffer])
        limit = int(self.byte_limits(side)[buffer])
        end = (page_start + num_pages) * item_len
        pages = (
            f"buffer {buffer}: {side} pages {page_start}..{page_start + num_pages - 1} "
            f"(item_len {item_len})"
        )
        first_bad_page = f"first page out of range: {max(page_start, limit // item_len)}"
        if getattr(self, f"{side}_lens") is None:
            ptr = int(getattr(self, f"{side}_ptrs")[buffer])
            return PlanValidationError(
                f"{pages} end at address {ptr + end}, past the int64 address space "
                f"({side}_ptrs[{buffer}] = {ptr}, last address 2**63 - 1); {first_bad_page}"
            )
        space = "device" if self.dst_is_device[buffer] else "host"
        hint = (
            f"; buffer {buffer} is {space}-backed: is the {space} page space right?"
            if side == "dst"
            else ""
        )
        return BoundsError(
            f"{pages} reach byte {end} past {side}_lens[{buffer}] = {limit}; {first_bad_page}{hint}"
        )

    def tables(self, torch_device: torch.device) -> dict[str, torch.Tensor]:
        """Per-buffer int64 tables on `torch_device`, copied once per torch device and cached.

        The copy is complete when this returns (`copy_tables_to_device`), so
        plans on any stream of any thread may read the cached tables.
        """
        if torch_device not in self._tables_by_torch_device:
            host_tables = {
                "src_ptrs": self.src_ptrs,
                "dst_ptrs": self.dst_ptrs,
                "item_lens": self.item_lens,
                "space": self.space.astype(np.int64),
                "host_before": self.host_before,
                "device_before": self.device_before,
                "src_lens": self.byte_limits("src"),
                "dst_lens": self.byte_limits("dst"),
            }
            self._tables_by_torch_device[torch_device] = copy_tables_to_device(
                host_tables, torch_device
            )
        return self._tables_by_torch_device[torch_device]

    def _check_length(self, name: str, values: np.ndarray) -> None:
        if len(values) != self.num_buffers:
            raise PlanValidationError(
                f"{name}: has {len(values)} entries but src_ptrs has {self.num_buffers}; "
                "every per-buffer list must have one entry per buffer"
            )

    def _check_values(self) -> None:
        checks = [("src_ptrs", self.src_ptrs, 0), ("dst_ptrs", self.dst_ptrs, 0)]
        checks.append(("item_lens", self.item_lens, 1))
        for name in ("src_lens", "dst_lens"):
            if getattr(self, name) is not None:
                checks.append((name, getattr(self, name), 0))
        for name, values, minimum in checks:
            bad = np.flatnonzero(values < minimum)
            if bad.size:
                b = int(bad[0])
                raise PlanValidationError(
                    f"{name}[{b}] = {int(values[b])}: must be >= {minimum} (buffer {b})"
                )
        for side in ("src", "dst"):
            ptrs, lens = getattr(self, f"{side}_ptrs"), getattr(self, f"{side}_lens")
            if lens is None:
                continue
            bad = np.flatnonzero(lens > INT64_MAX - ptrs)  # ptrs >= 0: no overflow
            if bad.size:
                b = int(bad[0])
                raise PlanValidationError(
                    f"{side}_ptrs[{b}] + {side}_lens[{b}] = {int(ptrs[b]) + int(lens[b])}: "
                    f"buffer {b} must end at or below address 2**63 - 1"
                )

"""Per-peer buffer layout: pointers, item lengths and destination spaces, built once."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gpu_planner.errors import BoundsError, PlanValidationError

HOST_SPACE = 0
DEVICE_SPACE = 1


def _as_int64(values: Sequence[int] | np.ndarray | torch.Tensor, name: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.cpu().numpy()
    array = np.asarray(values)
    if array.ndim != 1:
        raise PlanValidationError(f"{name}: expected a flat list, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iub":
        raise PlanValidationError(f"{name}: expected integers, got dtype {array.dtype}")
    if array.dtype == np.uint64 and array.size and int(array.max()) >= 2**63:
        raise PlanValidationError(f"{name}: value {int(array.max())} does not fit in int64")
    return array.astype(np.int64)


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Copy to `device`; to CUDA through pinned memory so the copy never blocks the host."""
    tensor = torch.from_numpy(values)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class BufferLayout:
    """The buffers of one prefill/decode peer pair, in layout (descriptor) order.

    Buffer `b` copies `item_lens[b]` bytes per page from `src_ptrs[b]` to
    `dst_ptrs[b]`. `dst_is_device[b]` picks the destination page space of that
    buffer (device pages when true, host pages otherwise). `src_lens`/`dst_lens`,
    when given, are the registered byte lengths used to bounds-check every
    descriptor before any byte moves.
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
            self.dst_is_device = _as_int64(dst_is_device, "dst_is_device").astype(bool)
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
        unbounded = np.full(self.num_buffers, np.iinfo(np.int64).max, dtype=np.int64)
        self._bound_limits = {
            "src": unbounded if self.src_lens is None else self.src_lens,
            "dst": unbounded if self.dst_lens is None else self.dst_lens,
        }
        self._device_tables: dict[torch.device, dict[str, torch.Tensor]] = {}

    @property
    def has_bounds(self) -> bool:
        return self.src_lens is not None or self.dst_lens is not None

    def first_device_buffer(self) -> int | None:
        return int(self.space_buffers[DEVICE_SPACE][0]) if self.num_device_buffers else None

    def bound_limits(self, side: str) -> np.ndarray:
        """Registered byte length per buffer on `side` ("src"/"dst"); int64 max when unknown."""
        return self._bound_limits[side]

    def bounds_error(self, buffer: int, side: str, page_start: int, num_pages: int) -> BoundsError:
        """The error for `buffer`'s descriptor over pages [page_start, +num_pages) on `side`."""
        item_len = int(self.item_lens[buffer])
        limit = int(self.bound_limits(side)[buffer])
        end = (page_start + num_pages) * item_len
        first_bad_page = max(page_start, limit // item_len)
        space = "device" if self.dst_is_device[buffer] else "host"
        hint = (
            f"; buffer {buffer} is {space}-backed: is the {space} page space right?"
            if side == "dst"
            else ""
        )
        return BoundsError(
            f"buffer {buffer}: {side} pages {page_start}..{page_start + num_pages - 1} "
            f"(item_len {item_len}) reach byte {end} past {side}_lens[{buffer}] = {limit}; "
            f"first page out of range: {first_bad_page}{hint}"
        )

    def tables(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Per-buffer int64 tables on `device`, copied once per device and cached."""
        if device not in self._device_tables:
            host_tables = {
                "src_ptrs": self.src_ptrs,
                "dst_ptrs": self.dst_ptrs,
                "item_lens": self.item_lens,
                "space": self.space.astype(np.int64),
                "host_before": self.host_before,
                "device_before": self.device_before,
                "src_lens": self.bound_limits("src"),
                "dst_lens": self.bound_limits("dst"),
            }
            self._device_tables[device] = {
                name: _to_device(np.ascontiguousarray(values), device)
                for name, values in host_tables.items()
            }
        return self._device_tables[device]

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

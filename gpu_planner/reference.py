"""Independent pure-Python reference of the planner semantics (slow, obviously correct).

It walks the pages one by one, like sglang 0.5.23's CPU path does per request,
and is what every backend is tested against and what the benchmark and the
demo's `--planner reference` compare with.
"""

from __future__ import annotations

from collections.abc import Sequence

Descriptors = tuple[list[int], list[int], list[int]]


def group_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs where both src and dst step by +1: (src_start, dst_start, length)."""
    if len(src) != len(dst):
        raise ValueError(f"src has {len(src)} pages but dst has {len(dst)}")
    runs: list[tuple[int, int, int]] = []
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        if i and s == src[i - 1] + 1 and d == dst[i - 1] + 1:
            src_start, dst_start, length = runs[-1]
            runs[-1] = (src_start, dst_start, length + 1)
        else:
            runs.append((int(s), int(d), 1))
    return runs


def batch_slices(num_pages: int, max_batch_pages: int) -> list[slice]:
    """Consecutive page slices of at most `max_batch_pages` (one slice when 0)."""
    if num_pages == 0:
        return []
    step = max_batch_pages if max_batch_pages > 0 else num_pages
    return [slice(start, start + step) for start in range(0, num_pages, step)]


def plan_batches(
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    item_lens: Sequence[int],
    dst_is_device: Sequence[bool] | None = None,
    dst_device_pages: Sequence[int] | None = None,
    max_batch_pages: int = 0,
) -> list[Descriptors]:
    """One (srcs, dsts, lens) triple per non-empty batch, in submission order."""
    src_pages, dst_pages = [int(p) for p in src_pages], [int(p) for p in dst_pages]
    device_pages = None if dst_device_pages is None else [int(p) for p in dst_device_pages]
    is_device = [False] * len(src_ptrs) if dst_is_device is None else list(dst_is_device)
    batches: list[Descriptors] = []
    for cut in batch_slices(len(src_pages), max_batch_pages):
        host_runs = group_runs(src_pages[cut], dst_pages[cut])
        device_runs = (
            None if device_pages is None else group_runs(src_pages[cut], device_pages[cut])
        )
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        for src_ptr, dst_ptr, item_len, on_device in zip(
            src_ptrs, dst_ptrs, item_lens, is_device, strict=True
        ):
            if on_device and device_runs is None:
                raise ValueError("a device-backed buffer needs dst_device_pages")
            for src_start, dst_start, length in device_runs if on_device else host_runs:
                srcs.append(int(src_ptr) + src_start * int(item_len))
                dsts.append(int(dst_ptr) + dst_start * int(item_len))
                lens.append(int(item_len) * length)
        if srcs:
            batches.append((srcs, dsts, lens))
    return batches

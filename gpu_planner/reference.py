"""Independent pure-Python reference of the planner semantics (slow, obviously correct).

It walks the pages one by one, like sglang 0.5.23's CPU path does per request,
and is what every backend is tested against and what the benchmark and the
demo's `--planner reference` compare with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gpu_planner.errors import BoundsError, PlanValidationError

INT64_MAX = 2**63 - 1
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
    src_lens: Sequence[int] | None = None,
    dst_lens: Sequence[int] | None = None,
) -> list[Descriptors]:
    """One (srcs, dsts, lens) triple per non-empty batch, in submission order.

    Raises `PlanValidationError` for input `plan_transfer` refuses: a page or a
    layout value outside int64, a negative page, and a descriptor that does not
    end at or below address 2**63 - 1 or, with `src_lens`/`dst_lens`, within its
    registered length (`BoundsError`). Python ints never wrap: each descriptor
    is checked as computed.
    """
    src_pages, dst_pages = [int(p) for p in src_pages], [int(p) for p in dst_pages]
    device_pages = None if dst_device_pages is None else [int(p) for p in dst_device_pages]
    is_device = [False] * len(src_ptrs) if dst_is_device is None else list(dst_is_device)
    registered = {"src": src_lens, "dst": dst_lens}
    _check_layout(src_ptrs, dst_ptrs, item_lens, registered)
    pages = {"src_pages": src_pages, "dst_pages": dst_pages}
    if device_pages is not None:
        pages["dst_device_pages"] = device_pages
    _check_pages(pages, uses_device_pages=any(is_device))
    batches: list[Descriptors] = []
    for cut in batch_slices(len(src_pages), max_batch_pages):
        host_runs = group_runs(src_pages[cut], dst_pages[cut])
        device_runs = (
            None if device_pages is None else group_runs(src_pages[cut], device_pages[cut])
        )
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        for buffer, (src_ptr, dst_ptr, item_len, device_space) in enumerate(
            zip(src_ptrs, dst_ptrs, item_lens, is_device, strict=True)
        ):
            if device_space and device_runs is None:
                raise ValueError("a device-backed buffer needs dst_device_pages")
            src_ptr, dst_ptr, item_len = int(src_ptr), int(dst_ptr), int(item_len)
            src_limit = _byte_limit(registered["src"], buffer, src_ptr)
            dst_limit = _byte_limit(registered["dst"], buffer, dst_ptr)
            for src_start, dst_start, run_pages in device_runs if device_space else host_runs:
                src_offset, dst_offset = src_start * item_len, dst_start * item_len
                length = item_len * run_pages
                if dst_offset + length > dst_limit:
                    raise _past_buffer(buffer, "dst", dst_ptr, dst_offset + length, registered)
                if src_offset + length > src_limit:
                    raise _past_buffer(buffer, "src", src_ptr, src_offset + length, registered)
                srcs.append(src_ptr + src_offset)
                dsts.append(dst_ptr + dst_offset)
                lens.append(length)
        if srcs:
            batches.append((srcs, dsts, lens))
    return batches


def _check_layout(
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    item_lens: Sequence[int],
    registered: dict[str, Sequence[int] | None],
) -> None:
    """Pointers in [0, 2**63), item lengths >= 1, buffers ending at or below 2**63 - 1.

    Booleans are refused: True is no address or length.
    """
    per_buffer = {"src_ptrs": src_ptrs, "dst_ptrs": dst_ptrs, "item_lens": item_lens}
    per_buffer.update(
        (f"{side}_lens", lens) for side, lens in registered.items() if lens is not None
    )
    for name, values in per_buffer.items():
        # Arrays and tensors (which have tolist) give their elements as Python scalars.
        for buffer, value in enumerate(values.tolist() if hasattr(values, "tolist") else values):
            if isinstance(value, bool):
                raise PlanValidationError(f"{name}[{buffer}] = {value!r}: a bool, not an integer")
    for name, values, minimum in (
        ("src_ptrs", src_ptrs, 0),
        ("dst_ptrs", dst_ptrs, 0),
        ("item_lens", item_lens, 1),
    ):
        for buffer, value in enumerate(values):
            if not minimum <= int(value) <= INT64_MAX:
                raise PlanValidationError(f"{name}[{buffer}] = {value}: out of range")
    for side, ptrs in (("src", src_ptrs), ("dst", dst_ptrs)):
        for buffer, length in enumerate(registered[side] or ()):
            if not 0 <= int(length) <= INT64_MAX - int(ptrs[buffer]):
                raise PlanValidationError(f"{side}_lens[{buffer}] = {length}: out of range")


def _check_pages(pages: dict[str, list[int]], uses_device_pages: bool) -> None:
    """Pages fit in int64; used ones are >= 0 (plan_transfer ignores unused device pages)."""
    for name, values in pages.items():
        minimum = 0 if name != "dst_device_pages" or uses_device_pages else -INT64_MAX - 1
        for position, page in enumerate(values):
            if not minimum <= page <= INT64_MAX:
                raise PlanValidationError(f"{name}[{position}] = {page}: out of range")


def _byte_limit(lens: Sequence[int] | None, buffer: int, ptr: int) -> int:
    """The bytes past `ptr` a descriptor may reach: the registered length, else up to 2**63 - 1."""
    return INT64_MAX - ptr if lens is None else int(lens[buffer])


def _past_buffer(
    buffer: int, side: str, ptr: int, end: int, registered: dict[str, Sequence[int] | None]
) -> PlanValidationError:
    """The error for a descriptor of `buffer` ending `end` bytes past its `side` pointer."""
    lens = registered[side]
    if lens is not None:
        return BoundsError(
            f"buffer {buffer}: {side} descriptor ends at byte {end} past "
            f"{side}_lens[{buffer}] = {lens[buffer]}"
        )
    return PlanValidationError(
        f"buffer {buffer}: {side} descriptor ends at address {ptr + end}, past 2**63 - 1"
    )


def plan_repaged(
    num_tokens: int,
    src_pages: Sequence[int],
    src_page_size: int,
    dst_pages: Sequence[int],
    dst_page_size: int,
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    src_item_lens: Sequence[int],
    src_first_token: int = 0,
    dst_first_token: int = 0,
    max_batch_tokens: int = 0,
) -> list[Descriptors]:
    """Descriptors of a send between two page sizes, walking token by token.

    Token `t` sits at slot `pages[(first + t) // P] * P + (first + t) % P` on
    each side; a run is a maximal stretch of tokens where both slots step by +1.
    The tokens sent are `num_tokens` rounded up to the joint page granularity
    (`gcd` of both page sizes and offsets), as an equal-page send sends whole
    last pages; batches cut every `max_batch_tokens` tokens (0 = one batch).
    Bytes per token: each buffer's `src_item_lens` (bytes per prefill page) /
    `src_page_size`.
    """
    granularity = math.gcd(src_page_size, dst_page_size, src_first_token, dst_first_token)
    sent = -(-num_tokens // granularity) * granularity

    def slot(pages: Sequence[int], page_size: int, first: int, token: int) -> int:
        position = first + token
        return int(pages[position // page_size]) * page_size + position % page_size

    batches: list[Descriptors] = []
    step = max_batch_tokens or max(sent, 1)
    for start in range(0, sent, step):
        runs: list[tuple[int, int, int]] = []
        for token in range(start, min(start + step, sent)):
            src = slot(src_pages, src_page_size, src_first_token, token)
            dst = slot(dst_pages, dst_page_size, dst_first_token, token)
            if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((src, dst, 1))
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        for src_ptr, dst_ptr, item_len in zip(src_ptrs, dst_ptrs, src_item_lens, strict=True):
            token_bytes = int(item_len) // src_page_size
            for src, dst, length in runs:
                srcs.append(int(src_ptr) + src * token_bytes)
                dsts.append(int(dst_ptr) + dst * token_bytes)
                lens.append(length * token_bytes)
        if srcs:
            batches.append((srcs, dsts, lens))
    return batches

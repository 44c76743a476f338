"""Prefill and decode with different page sizes: both sides' pages as pages of one common unit.

sglang's KV pools are token-slot arrays (slot = page * page_size + offset), so a
page is a name for `page_size` consecutive slots. A request's sent token `t`
(0 = the first token sent) sits, on a side with page size `P` whose page list
begins `first` tokens before that token, at slot

    slot(t) = pages[(first + t) // P] * P + (first + t) % P.

Both sides' slots step by one per token except where `first + t` crosses a
multiple of that side's `P`. With `unit = gcd(P_src, P_dst, first_src,
first_dst)` every such crossing is at a multiple of `unit` tokens, so each side
is a list of unit pages (unit page `u` = slots `u * unit .. u * unit + unit - 1`):

    unit_pages[k] = pages[(first + k * unit) // P] * (P // unit) + ((first + k * unit) % P) // unit,

and the planner's maximal runs over the two unit-page lists are exactly the
maximal joint contiguous slot runs: one descriptor per run per buffer, the
fewest the two geometries allow. A buffer's bytes per unit page is its bytes
per token times `unit`, and both sides must agree on the bytes per token.
The last unit page may hold slots past the request's last token, inside that
side's last page, as sglang's own send writes whole last pages.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from gpu_planner.errors import PlanValidationError

PageList = np.ndarray | torch.Tensor
INT64_MAX = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class PageGeometry:
    """How one side's page list holds the request's sent tokens.

    page_size: tokens per page (>= 1).
    first_token: how many of the page list's token positions come before the
        first sent token (a prefix the list covers but the send skips), >= 0.
    """

    page_size: int
    first_token: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.page_size, int) and self.page_size >= 1):
            raise PlanValidationError(f"page_size = {self.page_size!r}: not an integer >= 1")
        if not (isinstance(self.first_token, int) and self.first_token >= 0):
            raise PlanValidationError(f"first_token = {self.first_token!r}: not an integer >= 0")

    def describe(self) -> str:
        offset = f", first sent token at position {self.first_token}" if self.first_token else ""
        return f"page size {self.page_size}{offset}"


def common_unit(*geometries: PageGeometry) -> int:
    """Tokens per unit page: the largest count at which every side's page boundaries fall."""
    return math.gcd(*(value for g in geometries for value in (g.page_size, g.first_token)))


def unit_count(num_tokens: int, unit: int) -> int:
    """Unit pages that hold `num_tokens` sent tokens (the last one may be partly past them)."""
    return -(-num_tokens // unit)


def unit_pages(
    pages: PageList, geometry: PageGeometry, unit: int, num_tokens: int, name: str
) -> PageList:
    """`pages` (of `geometry`) as int64 pages of `unit` tokens, one per unit page sent.

    Works on NumPy arrays and torch tensors of any stride, on their device.
    Raises `PlanValidationError` naming `name` when the list holds too few
    pages for the tokens sent, or `unit` does not divide its geometry.
    """
    if geometry.page_size % unit or geometry.first_token % unit:
        raise PlanValidationError(f"{name}: unit {unit} does not divide {geometry.describe()}")
    per_page = geometry.page_size // unit
    first_unit = geometry.first_token // unit
    count = unit_count(num_tokens, unit)
    needed = -(-(first_unit + count) // per_page)
    if len(pages) < needed:
        raise PlanValidationError(
            f"{name}: {len(pages)} pages of {geometry.describe()} hold fewer than the "
            f"{num_tokens} tokens sent ({needed} pages needed)"
        )
    if isinstance(pages, torch.Tensor):
        held = pages[:needed].to(torch.int64)
        within = torch.arange(per_page, device=pages.device)
    else:
        held = np.asarray(pages[:needed]).astype(np.int64)
        within = np.arange(per_page, dtype=np.int64)
    _check_pages(held, per_page, geometry, name)
    if per_page == 1:  # the pages are the unit pages
        return held[first_unit : first_unit + count]
    return (held[:, None] * per_page + within).reshape(-1)[first_unit : first_unit + count]


def _check_pages(held: PageList, per_page: int, geometry: PageGeometry, name: str) -> None:
    """Every page is >= 0 and its unit pages fit in int64; else the first page at fault."""
    at_fault = (held < 0) | (held > INT64_MAX // per_page)
    if bool(at_fault.any()):
        position = int(at_fault.nonzero()[0][0])
        raise PlanValidationError(
            f"{name}[{position}] = {int(held[position])}: not a page of {geometry.describe()} "
            f"(negative, or past int64 counted in pages of {geometry.page_size // per_page} tokens)"
        )


def unit_item_lens(
    src_item_lens: Sequence[int],
    src: PageGeometry,
    dst_item_lens: Sequence[int],
    dst: PageGeometry,
    unit: int,
) -> list[int]:
    """Each buffer's bytes per unit page, from both sides' bytes per page.

    Raises `PlanValidationError` naming the buffer and both geometries where
    the two sides hold a different number of bytes per token (another KV
    dtype or head layout), or a page's bytes are not whole tokens.
    """
    if len(src_item_lens) != len(dst_item_lens):
        raise PlanValidationError(
            f"the prefill has {len(src_item_lens)} buffers, the decode {len(dst_item_lens)}"
        )
    unit_lens = []
    for buffer, (src_len, dst_len) in enumerate(zip(src_item_lens, dst_item_lens, strict=True)):
        src_len, dst_len = int(src_len), int(dst_len)
        token_bytes = src_len // src.page_size
        if src_len <= 0 or src_len % src.page_size or dst_len != token_bytes * dst.page_size:
            raise PlanValidationError(
                f"buffer {buffer}: the prefill's {src_len} bytes per page of "
                f"{src.describe()} and the decode's {dst_len} bytes per page of "
                f"{dst.describe()} are not the same bytes per token"
            )
        unit_lens.append(token_bytes * unit)
    return unit_lens

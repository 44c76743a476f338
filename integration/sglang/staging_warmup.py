"""The head-slice copies a Mooncake KV manager's staging can launch, compiled when it is built.

The prefill's send slots (`send_slots`) and the decode's receive region
(`receive_staging`) are made on first use, inside a request, and their
copies' kernel variants depend on the KV geometry (`gpu_planner.warmup.SliceCopies`).
That geometry is the manager's from the start: its buffers' addresses and
item lengths, its page size and its KV heads per rank. So the variants are
compiled when sglang builds the manager (`plugin.warm_up_gpu`), on the GPU
that holds the KV, and no request compiles one. What each path copies:

- prefill, staged send (generic or TP-down head slices): whole source pages
  of every buffer (page size 1, slices of an item length) into a slot;
- prefill, gathered TP-up send: `n` of its KV heads per token (the decode
  rank's share, 1 to all of them) at the server's page size, into a slot;
  toward a decode of another page size Q, at pages of gcd(page size, Q)
  tokens (`page_sizes.unit_send`), compiled when the prefill parses that
  decode's registration (`UnitGathers`: sglang parses it on its bootstrap
  thread, before any of the decode's requests);
- decode, scatter: a writer's share of each token slot, for `writers` (the
  prefill's attention TP over the decode's) dividing its KV heads, from its
  part of the region, which starts a multiple of `page bytes / writers` past
  an aligned reservation.

Slots and reservations start 256-byte aligned (`send_slots.SLOT_ALIGNMENT`,
`receive_staging.ALIGNMENT`), which the kernels see as 16-byte aligned.
Imports nothing from sglang until `warm_up_staging` runs:
`tests/kernels/aot_compile.py` sweeps these copies without it.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from gpu_planner import settings
from gpu_planner.integration.sglang.fallback import best_effort
from gpu_planner.warmup import SliceCopies, warm_up_slice_copies

_ALIGNMENT = 16  # bytes: the kernels' widest copy unit


def prefill_copies(
    ptrs: Sequence[int], item_lens: Sequence[int], page_size: int, kv_heads: int, mla: bool
) -> list[SliceCopies]:
    """The gathers a prefill with these KV buffers makes into its send slots."""
    item_lens = [int(length) for length in item_lens]
    return [
        _staged_gather(ptrs, item_lens),
        *_head_slice_gathers(ptrs, item_lens, page_size, kv_heads, mla, page_size),
    ]


def _staged_gather(ptrs: Sequence[int], page_lens: list[int]) -> SliceCopies:
    """The gather of a staged send: whole pages of `page_lens` bytes of every buffer."""
    return SliceCopies(
        scatter=False, page_size=1, slice_lens=tuple(page_lens), unit=_unit(ptrs, page_lens)
    )


def unit_copies(
    ptrs: Sequence[int],
    item_lens: Sequence[int],
    page_size: int,
    kv_heads: int,
    mla: bool,
    decode_page_size: int,
) -> list[SliceCopies]:
    """The gathers such a prefill adds toward a decode of `decode_page_size`: its sends go in
    pages of their gcd (`page_sizes.unit_send`): staged sends gather those whole pages, TP-up
    head slices are gathered per token on them. None where that is its page size."""
    unit = math.gcd(page_size, decode_page_size)
    if unit == page_size:
        return []  # `prefill_copies` has them
    item_lens = [int(length) for length in item_lens]
    unit_lens = [length // page_size * unit for length in item_lens]
    return [
        _staged_gather(ptrs, unit_lens),
        *_head_slice_gathers(ptrs, item_lens, page_size, kv_heads, mla, unit),
    ]


def _head_slice_gathers(
    ptrs: Sequence[int],
    item_lens: list[int],
    page_size: int,
    kv_heads: int,
    mla: bool,
    gather_page_size: int,
) -> list[SliceCopies]:
    """The TP-up head-slice gathers of a prefill's pages of `page_size` tokens, each launched
    on pages of `gather_page_size` tokens."""
    token_len = item_lens[0] // page_size if item_lens else 0
    head_len = token_len // max(kv_heads, 1)
    # sglang slices heads only for one item length and no MLA (`send_kvcache_slice`).
    if mla or not head_len or len(set(item_lens)) != 1:
        return []
    slices = tuple(heads * head_len for heads in range(1, kv_heads + 1))
    return [
        SliceCopies(
            scatter=False,
            page_size=gather_page_size,
            slice_lens=slices,
            unit=_unit(ptrs, [head_len, token_len]),
        )
    ]


def decode_copies(
    ptrs: Sequence[int], item_lens: Sequence[int], page_size: int, kv_heads: int
) -> list[SliceCopies]:
    """The scatters a decode with these KV buffers makes from its receive region."""
    item_lens = [int(length) for length in item_lens]
    page_bytes = sum(item_lens)
    copies = []
    for writers in (count for count in range(1, max(kv_heads, 1) + 1) if kv_heads % count == 0):
        if any(length % (page_size * writers) for length in item_lens) or page_bytes % writers:
            continue  # the decode refuses such a note (`ReceiveRegion._check`)
        slices = tuple(length // (page_size * writers) for length in item_lens)
        copies.append(
            SliceCopies(
                scatter=True,
                page_size=page_size,
                slice_lens=slices,
                unit=_unit(ptrs, slices),
                staging_step=page_bytes // writers,
                page_dtypes=(torch.int64,),  # the decode keeps its pages as int64 (`reserve`)
            )
        )
    return copies


def _unit(ptrs: Sequence[int], lens: Sequence[int]) -> int:
    """gcd(16, every address and length): what the copy unit of a chunk is a multiple of."""
    return math.gcd(_ALIGNMENT, *(int(value) for value in [*ptrs, *lens]))


def manager_copies(manager: Any) -> list[SliceCopies]:
    """The copies `manager`'s staging can make (none where its knobs turn staging off)."""
    ptrs, item_lens, page_size, kv_heads = _kv_geometry(manager)
    mode = getattr(getattr(manager, "disaggregation_mode", None), "name", None)
    if mode == "PREFILL" and settings.loaded(settings.GATHER_STAGING_BYTES):
        mla = bool(getattr(manager, "is_mla_backend", False))
        return prefill_copies(ptrs, item_lens, page_size, kv_heads, mla)
    if (
        mode == "DECODE"
        and settings.loaded(settings.RECEIVE_STAGING_BYTES)
        and not getattr(manager, "enable_staging", False)
    ):
        return decode_copies(ptrs, item_lens, page_size, kv_heads)
    return []


def _kv_geometry(manager: Any) -> tuple[list[int], list[int], int, int]:
    """`manager`'s KV buffer addresses, item lengths, page size and KV heads."""
    kv_args = manager.kv_args
    ptrs = [int(ptr) for ptr in kv_args.kv_data_ptrs]
    kv_heads = int(getattr(kv_args, "kv_head_num", 1) or 1)
    return ptrs, list(kv_args.kv_item_lens), int(kv_args.page_size), kv_heads


def warm_up_staging(manager: Any) -> int:
    """Compile `manager`'s staging copies on the GPU holding its KV (`manager_copies`); return
    the launches made (0 where the KV is not on one GPU: its copies run on the CPU loops)."""
    return _warm_up_on_kv_gpu(manager, manager_copies(manager))


def _warm_up_on_kv_gpu(manager: Any, copies: list[SliceCopies]) -> int:
    from gpu_planner.integration.sglang.receive_staging import receive_device
    from gpu_planner.integration.sglang.send_slots import kv_torch_device

    if not copies:
        return 0
    place = receive_device if copies[0].scatter else kv_torch_device
    torch_device = place(manager.kv_args)
    if isinstance(torch_device, str) or torch_device.type != "cuda":
        return 0  # host KV: its copies run on the CPU loops (`registered_region.kernel_backend`)
    return warm_up_slice_copies(torch_device, copies)


class UnitGathers:
    """This process's prefill managers, each with the unit page sizes whose gathers were
    compiled for it: a decode's page size adds some (`unit_copies`), once per manager and unit.

    Managers are kept weakly: a manager's end is not delayed.
    """

    def __init__(self) -> None:
        self._units: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def manager_built(self, manager: Any) -> None:
        """Keep prefill `manager` for the decodes that register later (where its slots are on)."""
        if not settings.loaded(settings.GATHER_STAGING_BYTES):
            return
        with (
            best_effort(
                "a prefill's gathers toward other page sizes compile in requests", "compile"
            ),
            self._lock,
        ):
            self._units.setdefault(manager, set())

    def decode_registered(self, decode_page_size: int) -> int:
        """Compile what a decode of `decode_page_size` adds to each kept manager's gathers, on
        the GPU holding its KV; return the launches made. Blocks, and never raises: sglang
        parses a registration on its bootstrap thread, before the decode's requests."""
        launches = 0
        with self._lock:  # held while compiling: each unit compiles once
            for manager, units in list(self._units.items()):
                with best_effort(
                    "compiling the gathers toward a decode's page size failed", "compile"
                ):
                    ptrs, item_lens, page_size, kv_heads = _kv_geometry(manager)
                    unit = math.gcd(page_size, decode_page_size)
                    if unit in units:
                        continue
                    units.add(unit)  # a failure is not retried: a request compiles it
                    mla = bool(getattr(manager, "is_mla_backend", False))
                    copies = unit_copies(
                        ptrs, item_lens, page_size, kv_heads, mla, decode_page_size
                    )
                    launches += _warm_up_on_kv_gpu(manager, copies)
        return launches

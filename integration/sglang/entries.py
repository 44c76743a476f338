"""The (src_ptr, dst_ptr, item_len) entries sglang's Mooncake send loop transfers.

`MooncakeKVManager._send_kvcache_generic` first validates the peer's state
strides, then maps prefill buffers to decode buffers (MLA flat entries, plain
MHA K/V halves, pipeline-parallel slices, published layer ids, elided entries).
This module reproduces that mapping by calling the manager's own helpers, so
the plugin plans exactly the buffers sglang would and only replaces the
run grouping and descriptor expansion.

sglang sends to one decode's buffers again and again: the mapping is kept per
peer layout (`layout_key`: every value it depends on, so a changed list, layer
id or manager field maps again), with what the hooks derive from it
(`Entries.derive`), for at most `GPU_PLANNER_LAYOUT_CACHE_SIZE` layouts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from sglang.srt.disaggregation.mooncake import conn

from gpu_planner import settings
from gpu_planner.integration.sglang.fallback import Failed

Entry = tuple[int, int, int]


@dataclasses.dataclass
class SendCall:
    """The arguments of `_send_kvcache_generic` (sglang 0.5.23), bound like the original.

    Fields, their order and their defaults mirror the original signature, so
    `SendCall(*args, **kwargs)` binds a call exactly as sglang does. The
    plugin checks this at register time and does not hook a different signature.
    """

    mooncake_session_id: str
    src_data_ptrs: list[int]
    dst_data_ptrs: list[int]
    item_lens: list[int]
    prefill_data_indices: Any
    dst_data_indices: Any
    executor: Any
    state_type: Any = None
    force_flat: bool = False
    src_layer_ids: list[int] | None = None
    dst_layer_ids: list[int] | None = None
    dst_device_data_indices: Any = None
    dst_device_data_ptrs: set[int] | None = None
    dst_item_lens: list[int] | None = None
    bootstrap_room: int | None = None


@dataclasses.dataclass(eq=False)
class Entries:
    """sglang's entries for one peer layout, as columns, and what the hooks built from them.

    One object serves every send with the same `layout_key` (read it, never
    change it): `derived` holds what a hook builds from the entries once per
    layout, under keys of its own (a few per layout, `derive` bounds them).
    """

    entries: tuple[Entry, ...]
    src_ptrs: tuple[int, ...]
    dst_ptrs: tuple[int, ...]
    item_lens: tuple[int, ...]
    strides_checked: bool = False  # sglang's stride check passed for these values
    derived: dict[Any, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, entries: list[Entry], strides_checked: bool = False) -> Entries:
        columns = tuple(zip(*entries, strict=True)) or ((), (), ())
        return cls(tuple(entries), *columns, strides_checked=strides_checked)

    def derive(self, key: Any, build: Callable[[], Any]) -> Any:
        """`derived[key]`, built by `build()` the first time (at most `MAX_DERIVED` kept)."""
        found = self.derived.get(key)
        if found is None:
            found = build()
            if len(self.derived) >= MAX_DERIVED:
                self.derived.clear()
            self.derived[key] = found
        return found


MAX_DERIVED = 8  # values a hook derives from one layout's entries (per device-buffer set)

# The manager's helpers that map a send's entries. Entries are kept only where each is
# sglang's own: then the mapping reads no more of the manager than `layout_key` holds.
_MAPPING_HELPERS = (
    "get_mla_kv_ptrs_with_pp",
    "get_mha_kv_ptrs_with_pp",
    "_mla_kv_entry_span_with_pp",
    "_mla_slice_ptrs_for_pp",
    "_state_stride_mismatch",
)
_MISSING = object()  # a field the manager lacks (the mapping raises where it reads one)


class _Kept:
    """A peer layout's place in the cache: empty until a send to it mapped its entries."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: Entries | None = None


@settings.sized_cache(settings.LAYOUT_CACHE_SIZE)
def _kept(key: tuple) -> _Kept:
    """The place of the layout `key` (`layout_key`): at most `GPU_PLANNER_LAYOUT_CACHE_SIZE`
    layouts, the least recently sent to dropped first."""
    return _Kept()


def transfer_entries(manager: conn.MooncakeKVManager, call: SendCall) -> Entries:
    """sglang's per-buffer entries for `call`; `Failed` where sglang returns before transferring.

    Mapped once per peer layout (`layout_key`) and kept; sglang's stride check
    runs where sglang would run it, until it passed once for these values.
    Side effects are sglang's own, logged by sglang's logger: a stride mismatch
    logs, concludes the room as failed and fails with -1; an out-of-range MHA
    stage logs and fails with -1.
    """
    stride_check = needs_stride_check(manager, call)
    try:
        key = layout_key(manager, call)
        kept = None if key is None else _kept(key)
    except TypeError:  # a value that is not hashable: mapped for this send only
        kept = None
    found = None if kept is None else kept.entries
    if found is not None:
        if stride_check and not found.strides_checked:
            check_state_strides(manager, call)
            found.strides_checked = True
        return found
    if stride_check:
        check_state_strides(manager, call)
    entries = Entries.of(mapped_entries(manager, call), strides_checked=stride_check)
    if kept is not None:
        kept.entries = entries
    return entries


def forget_entries() -> None:
    """Drop every kept peer layout's entries (tests)."""
    _kept.cache_clear()


def layout_key(manager: conn.MooncakeKVManager, call: SendCall) -> tuple | None:
    """Every value `mapped_entries(manager, call)` and the stride check depend on, hashable.

    The call's buffer lists, layer ids and flags, and the manager fields
    sglang's mapping helpers read (backend, pipeline stage, compressed-MLA
    ratios, draft entries). None where the manager has a helper of its own (a
    subclass or an instance attribute): its entries are not kept. Raises
    `TypeError` for a value that is not hashable.
    """
    if not _own_helpers(type(manager)) or not vars(manager).keys().isdisjoint(_MAPPING_HELPERS):
        return None
    kv_args = manager.kv_args
    ratios = getattr(kv_args, "mla_compression_ratios", None)
    return (
        type(manager),
        getattr(manager, "is_mla_backend", _MISSING),
        getattr(manager, "is_hybrid_mla_backend", _MISSING),
        getattr(manager, "pp_size", _MISSING),
        getattr(kv_args, "prefill_start_layer", _MISSING),
        getattr(kv_args, "prefill_end_layer", _MISSING),
        getattr(kv_args, "num_draft_entries", _MISSING),
        None if ratios is None else tuple(ratios),
        tuple(call.src_data_ptrs),
        tuple(call.dst_data_ptrs),
        tuple(call.item_lens),
        call.state_type,
        call.force_flat,
        _frozen(call.src_layer_ids),
        _frozen(call.dst_layer_ids),
        _frozen(call.dst_item_lens),
    )


@functools.lru_cache(maxsize=64)
def _own_helpers(manager_type: type) -> bool:
    """Whether `manager_type` maps entries with sglang's own helpers."""
    return all(
        getattr(manager_type, name, None) is getattr(conn.MooncakeKVManager, name)
        for name in _MAPPING_HELPERS
    )


def _frozen(values: Any) -> tuple | None:
    return None if values is None else tuple(values)


def needs_stride_check(manager: conn.MooncakeKVManager, call: SendCall) -> bool:
    """Whether sglang checks this send's state strides (not once registration validated them)."""
    return (
        call.dst_item_lens is not None
        and call.mooncake_session_id not in manager.state_strides_validated
    )


def check_state_strides(manager: conn.MooncakeKVManager, call: SendCall) -> None:
    """sglang's per-send stride check: on a mismatch, its log, its failed room and `Failed(-1)`."""
    mismatch = manager._state_stride_mismatch(
        src_data_ptrs=call.src_data_ptrs,
        dst_data_ptrs=call.dst_data_ptrs,
        item_lens=call.item_lens,
        dst_item_lens=call.dst_item_lens,
        state_type=call.state_type,
        force_flat=call.force_flat,
        src_layer_ids=call.src_layer_ids,
        dst_layer_ids=call.dst_layer_ids,
    )
    if mismatch is not None:
        assert call.bootstrap_room is not None
        conn.logger.error(mismatch)
        manager.conclude_failure(bootstrap_room=call.bootstrap_room, failure_reason=mismatch)
        raise Failed(-1)


def mapped_entries(manager: conn.MooncakeKVManager, call: SendCall) -> list[Entry]:
    """sglang's mapping of prefill buffers to decode buffers, its stride check aside."""
    has_layer_ids = bool(call.src_layer_ids or call.dst_layer_ids)
    is_flat = conn._uses_flat_entry_layout(
        mla_backend=manager.is_mla_backend or manager.is_hybrid_mla_backend,
        force_flat=call.force_flat,
        has_layer_ids=has_layer_ids,
        state_type=call.state_type,
        num_src_entries=len(call.src_data_ptrs),
        num_dst_entries=len(call.dst_data_ptrs),
    )
    if not is_flat:
        return _mha_entries(manager, call)
    if has_layer_ids:
        return _paired_entries(manager, call)
    return _positional_flat_entries(manager, call)


def _is_elided(call: SendCall, src_len: int, dst_lens: list[int] | None, dst_index: int) -> bool:
    return conn.is_elided_entry(
        src_len,
        dst_lens,
        dst_index,
        allow_dst_elision=call.state_type == conn.StateType.DSA,
    )


def _paired_entries(manager: conn.MooncakeKVManager, call: SendCall) -> list[Entry]:
    """Flat entries paired by published layer id (PP-local prefill to global decode)."""
    pairs = conn.build_transfer_entry_pairs(
        call.src_layer_ids,
        call.dst_layer_ids,
        len(call.src_data_ptrs),
        len(call.dst_data_ptrs),
        allow_positional_fallback=manager.pp_size == 1,
    )
    return [
        (call.src_data_ptrs[i], call.dst_data_ptrs[j], call.item_lens[i])
        for i, j in pairs
        if not _is_elided(call, call.item_lens[i], call.dst_item_lens, j)
    ]


def _positional_flat_entries(manager: conn.MooncakeKVManager, call: SendCall) -> list[Entry]:
    """Flat (MLA-style) entries by position, with the manager's PP slicing."""
    src_ptrs, dst_ptrs, num_layers = manager.get_mla_kv_ptrs_with_pp(
        call.src_data_ptrs, call.dst_data_ptrs, call.state_type
    )
    mapped_dst_lens = None
    if call.dst_item_lens is not None:
        _, mapped_dst_lens, _ = manager.get_mla_kv_ptrs_with_pp(
            call.item_lens, call.dst_item_lens, call.state_type
        )
    return [
        (src_ptrs[layer], dst_ptrs[layer], call.item_lens[layer])
        for layer in range(num_layers)
        if not _is_elided(call, call.item_lens[layer], mapped_dst_lens, layer)
    ]


def _mha_entries(manager: conn.MooncakeKVManager, call: SendCall) -> list[Entry]:
    """Plain MHA: every K entry of this PP stage, then every V entry."""
    src_k, src_v, dst_k, dst_v, num_layers = manager.get_mha_kv_ptrs_with_pp(
        call.src_data_ptrs, call.dst_data_ptrs
    )
    if num_layers > len(dst_k):
        conn.logger.error(
            "Prefill transfer kvcache error, layers_current_pp_stage is out of range: "
            f"layers_current_pp_stage={num_layers}, len(dst_k_ptrs)={len(dst_k)}"
        )
        raise Failed(-1)
    k_entries = [(src_k[i], dst_k[i], call.item_lens[i]) for i in range(num_layers)]
    v_entries = [(src_v[i], dst_v[i], call.item_lens[num_layers + i]) for i in range(num_layers)]
    return k_entries + v_entries

"""The (src_ptr, dst_ptr, item_len) entries sglang's Mooncake send loop transfers.

`MooncakeKVManager._send_kvcache_generic` first validates the peer's state
strides, then maps prefill buffers to decode buffers (MLA flat entries, plain
MHA K/V halves, pipeline-parallel slices, published layer ids, elided entries).
This module reproduces that mapping by calling the manager's own helpers, so
the plugin plans exactly the buffers sglang would and only replaces the
run grouping and descriptor expansion.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang.srt.disaggregation.mooncake import conn

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


def transfer_entries(manager: conn.MooncakeKVManager, call: SendCall) -> list[Entry]:
    """sglang's per-buffer entries for `call`; `Failed` where sglang returns before transferring.

    Side effects are sglang's own, logged by sglang's logger: a stride mismatch
    logs, concludes the room as failed and fails with -1; an out-of-range MHA
    stage logs and fails with -1.
    """
    mismatch = _state_stride_mismatch(manager, call)
    if mismatch is not None:
        assert call.bootstrap_room is not None
        conn.logger.error(mismatch)
        manager.conclude_failure(bootstrap_room=call.bootstrap_room, failure_reason=mismatch)
        raise Failed(-1)
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


def _state_stride_mismatch(manager: conn.MooncakeKVManager, call: SendCall) -> str | None:
    """The manager's stride check, skipped once registration validated this peer."""
    if call.dst_item_lens is None or call.mooncake_session_id in manager.state_strides_validated:
        return None
    return manager._state_stride_mismatch(
        src_data_ptrs=call.src_data_ptrs,
        dst_data_ptrs=call.dst_data_ptrs,
        item_lens=call.item_lens,
        dst_item_lens=call.dst_item_lens,
        state_type=call.state_type,
        force_flat=call.force_flat,
        src_layer_ids=call.src_layer_ids,
        dst_layer_ids=call.dst_layer_ids,
    )


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

"""A real `MooncakeKVManager` without a running engine, for tests and the benchmark.

sglang's manager constructor starts a transfer engine, threads and sockets.
`make_manager` builds the real class with `object.__new__` and sets only the
state `_send_kvcache_generic` reads (`make_decode_manager`: what a decode's
receive staging and status handling read), so sglang's own send (or the hooked one)
runs unchanged on it; `RecordingEngine` stands in for sglang's
`MooncakeTransferEngine` wrapper and records each batch call. Imports sglang.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.mooncake import conn

RecordedCall = tuple[str, list[int], list[int], list[int]]  # (session, srcs, dsts, lens)


class RecordingEngine:
    """Stands in for sglang's MooncakeTransferEngine: records each batch call, moves nothing.

    Returns 0, or `failure_status` for the call numbered `fail_at` (in call
    order), or for calls whose first source address lies in `fail_src_range`.
    The lists are kept as given (no copy), so recording costs the send nothing.
    """

    def __init__(
        self,
        fail_at: int | None = None,
        failure_status: int = -1,
        fail_src_range: range | None = None,
    ) -> None:
        self.calls: list[RecordedCall] = []
        self.fail_at = fail_at
        self.failure_status = failure_status
        self.fail_src_range = fail_src_range
        self._lock = threading.Lock()

    def batch_transfer_sync(
        self, session_id: str, buffers: list[int], peer_addresses: list[int], lengths: list[int]
    ) -> int:
        with self._lock:
            number = len(self.calls)
            self.calls.append((session_id, buffers, peer_addresses, lengths))
        failing_src = self.fail_src_range is not None and buffers[0] in self.fail_src_range
        return self.failure_status if number == self.fail_at or failing_src else 0


class FailureRecorder:
    """Records `conclude_failure(bootstrap_room=..., failure_reason=...)` calls."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, **kwargs) -> None:
        self.calls.append(kwargs)


def make_manager(
    engine,
    *,
    mla: bool = False,
    hybrid_mla: bool = False,
    pp_size: int = 1,
    start_layer: int = 0,
    end_layer: int | None = None,
    num_draft_entries: int = 0,
    custom_mem_pool: bool = False,
    custom_mem_pool_type: str = "NVLINK",
    max_transfer_batch_indices: int = 0,
    validated_sessions: tuple[str, ...] = (),
    deferred_release: bool = False,
    kv_data_ptrs: Sequence[int] = (),
    kv_data_lens: Sequence[int] = (),
    attn_tp_rank: int = 0,
    pp_rank: int = 0,
) -> conn.MooncakeKVManager:
    """A real MooncakeKVManager holding just the state `_send_kvcache_generic` reads.

    `engine` is what the manager sends through: a `RecordingEngine`, or
    sglang's real `MooncakeTransferEngine` wrapper around a Mooncake engine.
    `kv_data_ptrs`/`kv_data_lens` are the prefill's registered KV buffers: the
    hooks refuse to read outside them. `attn_tp_rank` and `pp_rank` (of
    `pp_size`) make the rank its status messages name.
    """
    kv_args = KVArgs()
    kv_args.kv_data_ptrs, kv_args.kv_data_lens = list(kv_data_ptrs), list(kv_data_lens)
    kv_args.prefill_start_layer = start_layer
    kv_args.prefill_end_layer = end_layer
    kv_args.mla_compression_ratios = None
    kv_args.num_draft_entries = num_draft_entries
    manager = object.__new__(conn.MooncakeKVManager)
    manager.kv_args = kv_args
    manager.engine = engine
    manager.is_mla_backend = mla
    manager.is_hybrid_mla_backend = hybrid_mla
    manager.pp_size = pp_size
    manager.enable_custom_mem_pool = custom_mem_pool
    manager.custom_mem_pool_type = custom_mem_pool_type
    manager.max_transfer_batch_indices = max_transfer_batch_indices
    manager.state_strides_validated = set(validated_sessions)
    manager.enable_deferred_decode_kv_release = deferred_release
    manager.conclude_failure = FailureRecorder()
    manager.attn_tp_rank, manager.pp_rank = attn_tp_rank, pp_rank  # its status's prefill rank
    manager.attn_cp_size, manager.attn_cp_rank = 1, 0
    manager.transfer_infos = {}  # room: {decode session: TransferInfo}, as sglang keeps them
    manager.deferred_bootstrap = None
    return manager


def make_decode_manager(
    engine,
    kv_data_ptrs: Sequence[int],
    kv_data_lens: Sequence[int],
    kv_item_lens: Sequence[int],
    page_size: int,
    mode: str = "DECODE",
    num_draft_entries: int = 0,
) -> conn.MooncakeKVManager:
    """A real MooncakeKVManager holding what receive staging and `apply_prefill_status` read.

    `engine` is the wrapper the region registers with; the KV buffers are the
    decode's (`mode` names the `DisaggregationMode`); with HiSparse, the last
    `num_draft_entries` buffers take the device pages (sglang's rule).
    """
    from sglang.srt.disaggregation.utils import DisaggregationMode

    kv_args = KVArgs()
    kv_args.kv_data_ptrs, kv_args.kv_data_lens = list(kv_data_ptrs), list(kv_data_lens)
    kv_args.kv_item_lens, kv_args.page_size = list(kv_item_lens), page_size
    kv_args.mla_compression_ratios, kv_args.num_draft_entries = None, num_draft_entries
    manager = object.__new__(conn.MooncakeKVManager)
    manager.kv_args, manager.engine = kv_args, engine
    manager.disaggregation_mode = DisaggregationMode[mode]
    manager.enable_staging = False
    manager.request_status = {}
    manager.prefill_response_tracker = {}
    manager.required_prefill_response_num_table = {}
    manager.defer_decode_allocation = False
    manager.deferred_bootstrap = None
    manager.failure_records, manager.failure_lock = {}, threading.Lock()
    # What sglang's receivers (`CommonKVReceiver`: open, abort, waiting timeout, clear) and
    # `update_status` read and write.
    manager.addr_to_rooms_tracker = collections.defaultdict(set)
    manager._deferred_ack_targets, manager._deferred_ack_poisoned_rooms = {}, set()
    manager._staging_outstanding = collections.defaultdict(int)
    manager.waiting_timeout = 300.0
    manager.connection_lock, manager.connection_pool = threading.Lock(), {}
    return manager

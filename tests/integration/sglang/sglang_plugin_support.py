"""The real sglang 0.5.23 with gpu_planner's plugin loaded, and a manager to call it on.

Importing this module imports sglang once per test session (about 10 s), keeps
sglang's original functions in `ORIGINALS` (HookRegistry rebinds every
module-level name bound to an original, so a dict is the safe place), then runs
sglang's own `load_plugins()`, which finds gpu_planner through its installed
entry point.
"""

from __future__ import annotations

import inspect
import os
import threading
import warnings

os.environ.pop("GPU_PLANNER_DISABLE", None)
os.environ.pop("SGLANG_PLUGINS", None)

with warnings.catch_warnings():
    # sglang warns that its GPU quantization kernels are unavailable on this machine.
    warnings.simplefilter("ignore")
    from sglang.srt.disaggregation import minimax  # does `from ...common import kv_to_page_indices`
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.mooncake import conn
    from sglang.srt.mem_cache import common
    from sglang.srt.plugins import load_plugins

ORIGINALS = {
    "send": inspect.unwrap(conn.MooncakeKVManager._send_kvcache_generic),
    "pages": inspect.unwrap(common.kv_to_page_indices),
}
load_plugins()

__all__ = [
    "ORIGINALS",
    "FailureRecorder",
    "RecordingEngine",
    "common",
    "conn",
    "hooked_send",
    "make_manager",
    "minimax",
]

EngineCall = tuple[str, list[int], list[int], list[int]]


class RecordingEngine:
    """Stands in for sglang's MooncakeTransferEngine: records each batch call.

    Returns 0, or `failure_status` for the call numbered `fail_at` (in call
    order), or for calls whose first source address lies in `fail_src_range`.
    """

    def __init__(
        self,
        fail_at: int | None = None,
        failure_status: int = -1,
        fail_src_range: range | None = None,
    ) -> None:
        self.calls: list[EngineCall] = []
        self.fail_at = fail_at
        self.failure_status = failure_status
        self.fail_src_range = fail_src_range
        self._lock = threading.Lock()

    def batch_transfer_sync(
        self, session_id: str, buffers: list[int], peer_addresses: list[int], lengths: list[int]
    ) -> int:
        with self._lock:
            number = len(self.calls)
            self.calls.append((session_id, list(buffers), list(peer_addresses), list(lengths)))
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
) -> conn.MooncakeKVManager:
    """A real MooncakeKVManager holding just the state `_send_kvcache_generic` reads."""
    kv_args = KVArgs()
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
    return manager


def hooked_send():
    """The `_send_kvcache_generic` sglang now runs (the plugin's wrapper)."""
    return conn.MooncakeKVManager._send_kvcache_generic

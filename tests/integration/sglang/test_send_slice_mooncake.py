"""The hooked `send_kvcache_slice` moves the right head slices between two real engines.

Prefill TP2 rank 1 sends to decode TP4 rank 3 (8 KV heads: prefill holds
heads 4-7, decode 6-7), through sglang's real `MooncakeTransferEngine` wrapper
around this process's real Mooncake engine, into a peer process's registered
buffers (tests/integration/mooncake's two-process harness), on the arrays
path (0.3.14) and on the forced list path. The expected decode buffers are
computed from the page lists alone, as [page, token, head, head bytes] arrays:
every byte of the sent heads, and nothing else, changes.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from sglang_plugin_support import conn, make_manager
from test_send_handoff import SpyEngine, sglang_wrapper

from gpu_planner import settings
from gpu_planner.integration.mooncake import handoff
from tests.integration.mooncake.mooncake_peer import two_sides

TOTAL_HEADS, HEAD_BYTES, PAGE_SIZE, POOL_PAGES, LAYERS = 8, 16, 4, 32, 3
SRC_TP, SRC_RANK, DST_TP, DST_RANK = 2, 1, 4, 3
SRC_HEADS, DST_HEADS = TOTAL_HEADS // SRC_TP, TOTAL_HEADS // DST_TP
SRC_ITEM_LEN = PAGE_SIZE * SRC_HEADS * HEAD_BYTES
DST_ITEM_LEN = PAGE_SIZE * DST_HEADS * HEAD_BYTES
SENT_HEADS = slice(2, 4)  # decode rank 3's heads 6-7 are prefill rank 1's local heads 2-3


def prefill_rank_manager(sides, buffers: int) -> tuple[conn.MooncakeKVManager, SpyEngine]:
    """Prefill rank SRC_RANK of TP SRC_TP over the local engine's `buffers` registered buffers."""
    manager = make_manager(sglang_wrapper(spy := SpyEngine(sides.local.engine)))
    manager.attn_tp_size = SRC_TP
    kv_args = manager.kv_args
    kv_args.kv_data_ptrs, kv_args.kv_item_lens = sides.local.ptrs, [SRC_ITEM_LEN] * buffers
    kv_args.kv_data_lens = [POOL_PAGES * SRC_ITEM_LEN] * buffers
    kv_args.kv_layer_ids, kv_args.page_size = [], PAGE_SIZE
    kv_args.engine_rank, kv_args.kv_head_num = SRC_RANK, SRC_HEADS
    kv_args.total_kv_head_num = TOTAL_HEADS
    return manager, spy


@pytest.mark.parametrize("path", [handoff.ARRAYS, handoff.LISTS])
def test_hooked_slice_send_moves_the_sent_heads_through_real_engines(monkeypatch, path):
    if path == handoff.LISTS:
        monkeypatch.setenv(settings.HANDOFF.name, "lists")
    buffers = 2 * LAYERS  # K of every layer, then V
    with two_sides(
        "push", [POOL_PAGES * SRC_ITEM_LEN] * buffers, [POOL_PAGES * DST_ITEM_LEN] * buffers
    ) as sides:
        assert hasattr(sides.local.engine, "batch_transfer_sync_write_arrays"), "needs 0.3.14"
        rng = np.random.default_rng(3)
        src_pages = rng.permutation(POOL_PAGES)[:20].astype(np.int32)
        dst_pages = rng.permutation(POOL_PAGES)[:20].astype(np.int64)
        manager, spy = prefill_rank_manager(sides, buffers)
        with concurrent.futures.ThreadPoolExecutor(max_workers=3) as executor:
            status = conn.MooncakeKVManager.send_kvcache_slice(
                manager,
                sides.peer.session_id,
                src_pages,
                sides.peer.ptrs,
                dst_pages,
                DST_RANK,
                DST_TP,
                DST_ITEM_LEN,
                executor,
            )
        assert status == 0
        assert spy.methods == [path] * buffers  # one call per K/V buffer of every layer
        expected = []
        for source, before in zip(sides.sources(), sides.destination_initial(), strict=True):
            src = source.reshape(POOL_PAGES, PAGE_SIZE, SRC_HEADS, HEAD_BYTES)
            dst = before.reshape(POOL_PAGES, PAGE_SIZE, DST_HEADS, HEAD_BYTES).copy()
            dst[dst_pages] = src[src_pages][:, :, SENT_HEADS]
            expected.append(dst.reshape(-1))
        for actual, wanted in zip(sides.destination(), expected, strict=True):
            np.testing.assert_array_equal(actual, wanted)

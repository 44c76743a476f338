"""End to end: the hooked sglang send drives the real Mooncake engine over 127.0.0.1.

Two sglang `MooncakeTransferEngine`s (TCP transport, P2P handshake) run in this
process: the prefill side owns the source KV buffers, the decode side the
destination buffers. After the hooked `_send_kvcache_generic` returns, every
destination byte must equal what the page mapping says, computed here from the
page lists alone, and every other byte must be untouched.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from sglang_plugin_support import KVPool, hooked_send, make_manager

POOL_PAGES = 256
NUM_PAGES = 60


class KVPools(list):
    """The registered KVPools of one test."""

    def make(self, *args, **kwargs) -> KVPool:
        self.append(KVPool(*args, pages=POOL_PAGES, **kwargs))
        return self[-1]


@pytest.fixture
def kv_pools():
    """A KVPools whose pools are deregistered after the test."""
    pools = KVPools()
    yield pools
    for pool in pools:
        pool.close()


def distinct_pages(rng: np.random.Generator, dtype) -> np.ndarray:
    """NUM_PAGES distinct pool pages: runs of 4 in shuffled order (adjacent ones may merge)."""
    runs = np.arange(POOL_PAGES).reshape(-1, 4)[rng.permutation(POOL_PAGES // 4)]
    return runs.reshape(-1)[:NUM_PAGES].astype(dtype)


def expected_bytes(src: KVPool, dst: KVPool, pairs: list[tuple[int, int, np.ndarray, np.ndarray]]):
    """Destination bytes after copying page `src_pages[i]` to `dst_pages[i]` per buffer pair."""
    expected = dst.tensor.numpy().copy()
    source = src.tensor.numpy()
    for src_buffer, dst_buffer, src_pages, dst_pages in pairs:
        for sp, dp in zip(src_pages.tolist(), dst_pages.tolist(), strict=True):
            expected[dst.page(dst_buffer, dp)] = source[src.page(src_buffer, sp)]
    return expected


def test_hisparse_mla_send_moves_the_right_bytes(engines, kv_pools):
    """MLA, 6 layers, last 2 device-backed (their own page ids), 7-page batches."""
    prefill, decode = engines
    rng = np.random.default_rng(0)
    src = kv_pools.make(prefill, [96] * 6, "random", seed=1)
    dst = kv_pools.make(decode, [96] * 6, "zeros")
    src_pages = distinct_pages(rng, np.int64)
    host_pages = distinct_pages(rng, np.int32)
    device_pages = distinct_pages(rng, np.int32)
    expected = expected_bytes(
        src,
        dst,
        [(b, b, src_pages, device_pages if b >= 4 else host_pages) for b in range(6)],
    )
    manager = make_manager(
        prefill,
        mla=True,
        max_transfer_batch_indices=7,
        kv_data_ptrs=src.ptrs,
        kv_data_lens=src.lens,
    )
    status = hooked_send()(
        manager,
        mooncake_session_id=decode.session_id,
        src_data_ptrs=src.ptrs,
        dst_data_ptrs=dst.ptrs,
        item_lens=src.item_lens,
        prefill_data_indices=src_pages,
        dst_data_indices=host_pages,
        executor=None,
        dst_device_data_indices=device_pages,
        dst_device_data_ptrs=set(dst.ptrs[4:]),
    )
    assert status == 0
    np.testing.assert_array_equal(dst.tensor.numpy(), expected)


def test_mha_pp_stage_custom_pool_send_moves_the_right_bytes(engines, kv_pools):
    """MHA K/V, prefill PP stage = decode layers 1..2 of 4, per-layer threaded path."""
    prefill, decode = engines
    rng = np.random.default_rng(1)
    k_len, v_len = 128, 64
    src = kv_pools.make(prefill, [k_len] * 2 + [v_len] * 2, "random", seed=2)
    dst = kv_pools.make(decode, [k_len] * 4 + [v_len] * 4, "zeros")
    src_pages = distinct_pages(rng, np.int64)
    dst_pages = distinct_pages(rng, np.int64)
    # Prefill K layer i -> decode K layer 1 + i; prefill V layer i -> decode V layer 1 + i.
    pairs = [(0, 1), (1, 2), (2, 5), (3, 6)]
    expected = expected_bytes(src, dst, [(s, d, src_pages, dst_pages) for s, d in pairs])
    manager = make_manager(
        prefill,
        start_layer=1,
        custom_mem_pool=True,
        pp_size=2,
        kv_data_ptrs=src.ptrs,
        kv_data_lens=src.lens,
    )
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as executor:
        status = hooked_send()(
            manager,
            decode.session_id,
            src.ptrs,
            dst.ptrs,
            src.item_lens,
            src_pages,
            dst_pages,
            executor,
        )
    assert status == 0
    np.testing.assert_array_equal(dst.tensor.numpy(), expected)

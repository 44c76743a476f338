"""The head-sliced send path: sglang's `send_kvcache_slice` and the hooked one, into a real engine.

A Llama-70B-like KV cache (80 layers, 8 KV heads, head dim 128, bf16, page
size 64), prefill TP2 rank 0 -> decode TP4 rank 1: each token sends 2 of its
4 heads, one descriptor per token per K/V buffer per layer (2 * 80 engine
calls). Both sends run on one `MooncakeKVManager` through sglang's real
`MooncakeTransferEngine` wrapper around a real Mooncake engine whose calls go
to a refusing peer (`send_path.REFUSING_PEER`): each call returns right after
Mooncake's binding has taken the descriptors. sglang stops submitting layers
after the first failure, so a thin proxy reports the refused -1 as 0: every
layer runs, as on a live peer. The executor has 3 threads (sglang's default
pool on a 192-CPU node with its 4 transfer queues).

Timing is `bench.harness`'s, the GIL figures `bench.gil`'s (through `bench.send_path`). Run:
`python -m bench.slice_path [--tokens 32768 131072]`; prints one JSON object.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import inspect
import json
from typing import Any

import numpy as np

from bench.harness import RepeatPolicy
from bench.send_path import REFUSING_PEER, measure_sends
from gpu_planner.integration.mooncake.engine import QUIET_ENV, TCP_ONLY_ENV, set_mooncake_defaults

LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES, PAGE_SIZE = 80, 8, 128, 2, 64
SRC_TP, SRC_RANK, DST_TP, DST_RANK = 2, 0, 4, 1
EXECUTOR_THREADS = 3


class RefusalAsSuccess:
    """A raw Mooncake engine (list API) whose refused calls report 0, so every layer is sent."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def batch_transfer_sync_write(self, *args) -> int:
        self.engine.batch_transfer_sync_write(*args)
        return 0


class ArraysRefusalAsSuccess(RefusalAsSuccess):
    """`RefusalAsSuccess` for an engine with the arrays API too (Mooncake 0.3.14)."""

    def batch_transfer_sync_write_arrays(self, *args) -> int:
        self.engine.batch_transfer_sync_write_arrays(*args)
        return 0


def refusal_as_success(engine) -> RefusalAsSuccess:
    """The proxy with the write methods `engine` has: the hook picks its hand-off by them."""
    if hasattr(type(engine), "batch_transfer_sync_write_arrays"):
        return ArraysRefusalAsSuccess(engine)
    return RefusalAsSuccess(engine)


class SlicePathBench:
    """sglang's head-sliced send and the hooked one, on one manager with a real, refused engine."""

    def __init__(self) -> None:
        set_mooncake_defaults(QUIET_ENV, TCP_ONLY_ENV)  # before sglang's wrapper starts one
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            MooncakeTransferEngine,
        )

        from bench.sglang_manager import make_manager
        from gpu_planner import head_slices
        from gpu_planner.integration.sglang import send_slice
        from gpu_planner.integration.sglang.adapter import sglang_handoff
        from gpu_planner.integration.sglang.fallback import around

        wrapper = MooncakeTransferEngine("127.0.0.1")
        wrapper.engine = refusal_as_success(wrapper.engine)
        self.handoff = sglang_handoff(wrapper).form
        self._original = inspect.unwrap(MooncakeKVManager.send_kvcache_slice)
        self._hook = around(send_slice.send_kvcache_slice_hook)
        head_slices.compile_kernels()  # as the plugin does at registration
        manager = make_manager(wrapper)
        manager.attn_tp_size = SRC_TP
        src_heads, self.dst_heads = KV_HEADS // SRC_TP, KV_HEADS // DST_TP
        src_item_len = PAGE_SIZE * src_heads * HEAD_DIM * DTYPE_BYTES
        self.dst_item_len = PAGE_SIZE * self.dst_heads * HEAD_DIM * DTYPE_BYTES
        kv_args = manager.kv_args
        kv_args.kv_data_ptrs = [2**40 + buffer * 2**34 for buffer in range(2 * LAYERS)]
        kv_args.kv_data_lens = [2**34] * (2 * LAYERS)  # registered: the hook reads only these
        kv_args.kv_item_lens = [src_item_len] * (2 * LAYERS)
        kv_args.kv_layer_ids, kv_args.page_size = [], PAGE_SIZE
        kv_args.engine_rank, kv_args.kv_head_num, kv_args.total_kv_head_num = (
            SRC_RANK,
            src_heads,
            KV_HEADS,
        )
        self._manager = manager
        self._executor = concurrent.futures.ThreadPoolExecutor(EXECUTOR_THREADS)
        self._arguments: tuple = ()

    def prepare(self, num_tokens: int, seed: int = 0) -> None:
        """A request of `num_tokens` tokens on shuffled pages of a pool twice its size."""
        num_pages = num_tokens // PAGE_SIZE
        rng = np.random.default_rng(seed)
        src_pages = rng.permutation(2 * num_pages)[:num_pages].astype(np.int32)
        dst_pages = rng.permutation(2 * num_pages)[:num_pages].astype(np.int32)
        dst_ptrs = [2**46 + buffer * 2**34 for buffer in range(2 * LAYERS)]
        self._arguments = (
            REFUSING_PEER,
            src_pages,
            dst_ptrs,
            dst_pages,
            DST_RANK,
            DST_TP,
            self.dst_item_len,
            self._executor,
        )

    def send_sglang(self) -> int:
        return self._original(self._manager, *self._arguments)

    def send_hooked(self) -> int:
        return self._hook(self._original, self._manager, *self._arguments)

    def measure(self, policy: RepeatPolicy) -> dict[str, Any]:
        """Both sends timed interleaved under the GIL monitor; statuses must agree."""
        statuses = {"sglang": self.send_sglang(), "hooked": self.send_hooked()}
        if statuses["sglang"] != statuses["hooked"]:
            raise RuntimeError(f"send statuses differ: {statuses}")
        sends = {"sglang": self.send_sglang, "hooked": self.send_hooked}
        figures = measure_sends(sends, policy)
        return {"handoff": self.handoff, "status": statuses["sglang"], **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--budget-s", type=float, default=5.0, help="per variant and size")
    args = parser.parse_args()
    bench = SlicePathBench()
    results = {}
    for num_tokens in args.tokens:
        bench.prepare(num_tokens)
        policy = RepeatPolicy(budget_s=args.budget_s, min_repeats=3, max_repeats=50)
        results[num_tokens] = bench.measure(policy)
    print(json.dumps({"handoff": bench.handoff, "tokens": results}, indent=1))


if __name__ == "__main__":
    main()

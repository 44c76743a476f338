"""Head-sliced sends to a live peer: sglang's, the per-token hook's, and the gathered hook's.

The refused peer of `bench.slice_path` stops each call before Mooncake builds
its requests; here a live peer engine in another process (TCP on 127.0.0.1)
takes every byte, which is the cost the gathered send removes: Mooncake's
TCP transport pays per request. Llama-70B-like KV heads (8 KV heads, head dim
128, bf16, page size 64) over `--layers` layers (K and V buffers each), real
source buffers of random bytes, shuffled pages:

- TP2 -> TP4 (prefill rank 0 -> decode rank 1): `sglang` (its own
  `send_kvcache_slice`), `per_token` (the hook with the gathered path off:
  one arrays call per buffer, one after another), `gathered` (the hook:
  gather into registered staging, one call per chunk of buffers);
- TP4 -> TP2 (prefill rank 1 -> decode rank 0), where each decode slot is
  written by two prefill ranks: `sglang`, `per_token` (the hook toward a
  decode that offered no receive staging), `pages` (one Mooncake 0.3.14
  `batch_transfer_sync_write_pages` call holding every buffer's tokens), the
  alternative the hook's per-layer calls are held to, and `staged` (the
  hooked `send_kvcache_slice` toward a decode that advertised receive
  staging, a second part of the peer's registered region, and lent the
  request a part, parsed by the plugin's hooked parsers: this rank's heads,
  one of two shares of each decode slot, gathered page by page of every
  buffer into the send slots and written with one descriptor per
  slot-sized piece). `scatter` times, on this machine, what the decode then
  does (`bench.staged_send.DecodeScatter`: the note's chunks scattered into
  host buffers of the decode's sizes); `staged_with_scatter_s` is the sum of
  the two medians.

Per variant: wall time (`bench.harness`), GIL holds and waits (`bench.gil`,
through `bench.send_path.measure_sends`), descriptors and bytes handed to
Mooncake. With `--verify`, each variant first sends once into cleared peer
memory, read back (staged: its staging scattered here), which must hold the
source slices in the decode's slots and nothing else (`landed_as_expected`).
Run: `python -m bench.gathered_slice [--tokens 4096 32768] [--verify]`;
prints JSON. Needs Mooncake 0.3.14.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import inspect
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.harness import RepeatPolicy
from bench.live_submit import live_peer
from bench.send_path import measure_sends
from bench.staged_send import (
    DecodeScatter,
    PeerMemory,
    counted,
    expected_pool,
    offer_receive_staging,
    offered,
)
from gpu_planner import settings
from gpu_planner.integration.mooncake.engine import QUIET_ENV, TCP_ONLY_ENV, set_mooncake_defaults

KV_HEADS, HEAD_BYTES, PAGE_SIZE = 8, 128 * 2, 64
SPARE_PAGES = 16
EXECUTOR_THREADS = 3
DIRECTIONS = {"tp2_to_tp4": (2, 0, 4, 1), "tp4_to_tp2": (4, 1, 2, 0)}  # src tp, rank, dst tp, rank
STAGED_DIRECTIONS = ("tp4_to_tp2",)  # TP-down: each prefill rank writes a share of every slot


def peer_layout(direction: str, layers: int, num_tokens: int) -> tuple[int, int]:
    """(bytes of the peer's registered memory, where the receive staging starts in it).

    The decode's KV pool (every K/V buffer's pages) comes first; the receive
    staging holds one request's pages of every buffer.
    """
    buffers, num_pages = 2 * layers, num_tokens // PAGE_SIZE
    dst_item_len = PAGE_SIZE * KV_HEADS // DIRECTIONS[direction][2] * HEAD_BYTES
    region = buffers * (num_pages + SPARE_PAGES) * dst_item_len
    full_heads = buffers * (num_pages + SPARE_PAGES) * PAGE_SIZE * KV_HEADS * HEAD_BYTES
    return max(full_heads, region + buffers * num_pages * dst_item_len), region


class GatheredSliceBench:
    """Every variant of one direction's send on managers whose engine reaches a live peer."""

    def __init__(self, direction: str, layers: int, num_tokens: int, peer: tuple[str, int]):
        set_mooncake_defaults(QUIET_ENV, TCP_ONLY_ENV)
        from sglang.srt.disaggregation.mooncake import conn
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            MooncakeTransferEngine,
        )
        from sglang.srt.plugins import load_plugins

        from bench.sglang_manager import make_manager
        from gpu_planner.integration.sglang import gathered, send_slots

        load_plugins()  # the gpu_planner hooks, from the installed entry point
        self._gathered, self._send_slots = gathered, send_slots
        self.session, peer_address = peer
        src_tp, src_rank, dst_tp, dst_rank = DIRECTIONS[direction]
        src_heads, dst_heads = KV_HEADS // src_tp, KV_HEADS // dst_tp
        self.src_item_len = PAGE_SIZE * src_heads * HEAD_BYTES
        self.dst_item_len = PAGE_SIZE * dst_heads * HEAD_BYTES
        self.num_pages = num_tokens // PAGE_SIZE
        pool_pages = self.num_pages + SPARE_PAGES
        self.pool_pages = pool_pages
        buffers = 2 * layers
        rng = np.random.default_rng(0)
        self.sources = [
            rng.integers(0, 256, pool_pages * self.src_item_len, dtype=np.uint8)
            for _ in range(buffers)
        ]
        self.wrapper = MooncakeTransferEngine("127.0.0.1")
        for source in self.sources:
            self.wrapper.register(source.ctypes.data, source.nbytes)
        self.src_pages = rng.permutation(pool_pages)[: self.num_pages].astype(np.int32)
        self.dst_pages = rng.permutation(pool_pages)[: self.num_pages].astype(np.int32)
        self.dst_ptrs = [
            peer_address + buffer * pool_pages * self.dst_item_len for buffer in range(buffers)
        ]
        self.dst_tp, self.dst_rank = dst_tp, dst_rank
        self.slice_len = min(src_heads, dst_heads) * HEAD_BYTES
        self.src_head_offset = (dst_rank * dst_heads % src_heads) * HEAD_BYTES * (src_tp < dst_tp)
        self.dst_head_offset = (src_rank * src_heads % dst_heads) * HEAD_BYTES * (src_tp > dst_tp)
        self._original = inspect.unwrap(conn.MooncakeKVManager.send_kvcache_slice)
        self._hooked = conn.MooncakeKVManager.send_kvcache_slice
        self.managers = {}
        for name, staging in (("per_token", "0"), ("gathered", "")):
            os.environ["GPU_PLANNER_GATHER_STAGING_BYTES"] = staging
            settings.load()  # a process parses knobs once: the benchmark loads each variant's
            manager = make_manager(self.wrapper)
            manager.attn_tp_size = src_tp
            kv_args = manager.kv_args
            kv_args.kv_data_ptrs = [source.ctypes.data for source in self.sources]
            kv_args.kv_data_lens = [source.nbytes for source in self.sources]
            kv_args.kv_item_lens = [self.src_item_len] * buffers
            kv_args.kv_layer_ids, kv_args.page_size = [], PAGE_SIZE
            kv_args.engine_rank, kv_args.kv_head_num = src_rank, src_heads
            kv_args.total_kv_head_num = KV_HEADS
            send_slots.SEND_SLOTS.get(manager)  # registered now, read from the environment
            self.managers[name] = manager
        os.environ.pop("GPU_PLANNER_GATHER_STAGING_BYTES")
        settings.load()
        self.executor = concurrent.futures.ThreadPoolExecutor(EXECUTOR_THREADS)
        self.peer_address = peer_address
        self.offer = self.scatter = None
        if direction in STAGED_DIRECTIONS:
            self._offer_receive_staging(direction, layers, num_tokens)

    def _offer_receive_staging(self, direction: str, layers: int, num_tokens: int) -> None:
        """The decode (the live peer) advertises receive staging after its KV pool and lends
        the request a part; the staged send goes from the manager with send slots."""
        buffers = len(self.sources)
        _, region = peer_layout(direction, layers, num_tokens)
        manager = self.managers["gathered"]  # the send slots the staged path gathers into
        self.offer = offer_receive_staging(
            manager,
            self.session,
            (
                self.dst_ptrs,
                [self.dst_item_len] * buffers,
                [self.pool_pages * self.dst_item_len] * buffers,
            ),
            (self.peer_address + region, self.num_pages * buffers * self.dst_item_len),
            self.dst_pages,
            tp=(self.dst_rank, self.dst_tp),
        )
        self.staged_dst_pages = self.offer.info.dst_kv_indices[: self.num_pages]
        self.scatter = DecodeScatter(
            [self.dst_item_len] * buffers, self.pool_pages, PAGE_SIZE, self.dst_pages
        )

        def keep_note(_endpoint: str, frames: list[bytes], is_ipv6: bool = False) -> None:
            from gpu_planner.integration.sglang.staging_wire import Staged

            self.scatter.note = Staged.from_frames(frames)  # instead of ZMQ to the decode

        manager._send_multipart_locked = keep_note

    def _send(self, send: Callable, manager: Any, dst_pages: np.ndarray | None = None) -> int:
        return send(
            manager,
            self.session,
            self.src_pages,
            self.dst_ptrs,
            self.dst_pages if dst_pages is None else dst_pages,
            self.dst_rank,
            self.dst_tp,
            self.dst_item_len,
            self.executor,
        )

    def _hooked_send(self, manager: Any, staged: bool = False) -> int:
        """The hooked send; toward a decode offering receive staging when `staged`."""
        if not staged:
            with offered(self.session, None):
                return self._send(self._hooked, manager)
        with offered(self.session, self.offer.capability):
            return self._send(self._hooked, manager, self.staged_dst_pages)

    def variants(self, direction: str) -> dict[str, Callable[[], int]]:
        per_token = self.managers["per_token"]
        variants = {
            "sglang": lambda: self._send(self._original, per_token),
            "per_token": lambda: self._hooked_send(per_token),
        }
        if direction == "tp2_to_tp4":
            gathered = self.managers["gathered"]
            variants["gathered"] = lambda: self._hooked_send(gathered)
        else:
            variants["pages"] = self._pages_call()
        if self.offer is not None:
            staging = self.managers["gathered"]
            variants["staged"] = lambda: self._hooked_send(staging, staged=True)
        return variants

    def verify(self, variants: dict[str, Callable[[], int]]) -> dict[str, bool]:
        """Each variant once into cleared peer memory: the decode's slots hold the slices."""
        buffers = len(self.sources)
        pool_bytes = buffers * self.pool_pages * self.dst_item_len
        expected = expected_pool(
            self.sources, self.pool_pages, self.src_pages, self.dst_pages,
            (self.src_item_len // PAGE_SIZE, self.dst_item_len // PAGE_SIZE),
            (self.src_head_offset, self.dst_head_offset), self.slice_len, PAGE_SIZE,
        )  # fmt: skip
        staging = 0 if self.offer is None else self.offer.reservation.nbytes
        peer = PeerMemory(self.wrapper, self.session, self.peer_address, pool_bytes + staging)
        landed = {}
        try:
            for name, send in variants.items():
                peer.clear()
                status = send()
                pool = peer.read(0, pool_bytes)
                if name == "staged":
                    region = self.offer.capability.address - self.peer_address
                    if pool.any():  # a staged send writes the staging region only
                        landed[name] = False
                        continue
                    self.scatter.staging[:] = peer.read(region, staging)
                    self.scatter.pool[:] = 0
                    self.scatter()
                    pool = self.scatter.pool
                landed[name] = status == 0 and np.array_equal(pool, expected)
        finally:
            peer.close()
        return landed

    def _pages_call(self) -> Callable[[], int]:
        """One `batch_transfer_sync_write_pages` call: token slots as pages, a field per buffer."""
        token = np.arange(PAGE_SIZE, dtype=np.int64)
        src_slots = (self.src_pages.astype(np.int64)[:, None] * PAGE_SIZE + token).reshape(-1)
        dst_slots = (self.dst_pages.astype(np.int64)[:, None] * PAGE_SIZE + token).reshape(-1)
        src_token, dst_token = self.src_item_len // PAGE_SIZE, self.dst_item_len // PAGE_SIZE
        fields = np.array(
            [
                [
                    source.ctypes.data + self.src_head_offset,
                    src_token,
                    dst_ptr + self.dst_head_offset,
                    dst_token,
                    self.slice_len,
                ]
                for source, dst_ptr in zip(self.sources, self.dst_ptrs, strict=True)
            ],
            dtype=np.int64,
        )
        engine = self.wrapper.engine
        return lambda: engine.batch_transfer_sync_write_pages(
            self.session, src_slots, dst_slots, fields, 0
        )

    def counts(self, name: str) -> dict[str, int]:
        """Descriptors and bytes the variant hands to Mooncake (staged: counted in `measure`)."""
        buffers, tokens = len(self.sources), self.num_pages * PAGE_SIZE
        if name == "staged":
            return {}
        if name != "gathered":
            return {"descriptors": buffers * tokens, "bytes": buffers * tokens * self.slice_len}
        from gpu_planner.reference import group_runs

        slots = self._send_slots.SEND_SLOTS.get(self.managers["gathered"])
        chunks = self._gathered.plan_chunks(
            buffers, self.num_pages, self.dst_item_len, slots.slot_bytes
        )
        runs = len(group_runs(range(self.num_pages), self.dst_pages.tolist()))
        equal_tp = len(group_runs(self.src_pages.tolist(), self.dst_pages.tolist()))
        return {
            "descriptors": buffers * runs,
            "equal_tp_descriptors": buffers * equal_tp,
            "bytes": buffers * self.num_pages * self.dst_item_len,
            "calls": len(chunks),
        }


def measure(
    direction: str, layers: int, num_tokens: int, budget_s: float, verify: bool = False
) -> dict[str, Any]:
    from gpu_planner.integration.sglang.prefill_routes import ROUTES

    peer_bytes, _ = peer_layout(direction, layers, num_tokens)
    with live_peer(peer_bytes) as peer:
        try:
            bench = GatheredSliceBench(direction, layers, num_tokens, peer)
            variants = bench.variants(direction)
            landed = bench.verify(variants) if verify else None
            sent = {name: counted(send) for name, send in variants.items()}
            statuses = {name: figures["status"] for name, figures in sent.items()}
            if any(statuses.values()):
                raise RuntimeError(f"statuses {statuses}: every send to the live peer must succeed")
            stages: dict[str, Callable[[], Any]] = dict(variants)
            if bench.scatter is not None:
                stages["scatter"] = bench.scatter
            policy = RepeatPolicy(budget_s=budget_s, min_repeats=2, max_repeats=20)
            figures = measure_sends(stages, policy)
        finally:
            ROUTES.forget()
    for name in variants:
        figures[name].update(bench.counts(name))
    if "staged" in variants:
        note = bench.scatter.note
        figures["staged"].update(
            descriptors=sent["staged"]["descriptors"],
            bytes=sent["staged"]["bytes"],
            sends=sent["staged"]["sends"],
            chunks=len(note.chunks),
            writers=note.writers,
            writer=note.writer,
        )
        with_scatter = figures["staged"]["median"] + figures["scatter"]["median"]
        figures["staged_with_scatter_s"] = with_scatter
        figures["sglang/staged_with_scatter"] = figures["sglang"]["median"] / with_scatter
        figures["per_token/staged_with_scatter"] = figures["per_token"]["median"] / with_scatter
    figures["speedup_vs_sglang"] = {
        name: figures["sglang"]["median"] / figures[name]["median"] for name in variants
    }
    if landed is not None:
        figures["landed_as_expected"] = landed
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument(
        "--directions", nargs="+", choices=list(DIRECTIONS), default=list(DIRECTIONS)
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=10.0, help="per variant and size")
    parser.add_argument("--verify", action="store_true", help="check what lands, first")
    args = parser.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    # The staged variant stages whatever the cost model would choose (the gate, set, decides).
    os.environ.setdefault("GPU_PLANNER_STAGING_MIN_DESCRIPTORS", "1")
    results = {
        direction: {
            tokens: measure(direction, args.layers, tokens, args.budget_s, args.verify)
            for tokens in args.tokens
        }
        for direction in args.directions
    }
    print(json.dumps({"layers": args.layers, "results": results}, indent=1))


if __name__ == "__main__":
    main()

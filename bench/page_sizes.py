"""Sends between a plugin prefill and a plugin decode of different page sizes, to a live peer.

sglang refuses a prefill and a decode whose `--page-size` differ; the plugin
serves them (`integration/sglang/page_sizes.py`): the prefill sends each chunk
as unit pages of gcd(page sizes) on both sides. This times that send against a
live peer engine in another process (`bench.live_submit.live_peer`, TCP on
127.0.0.1), for each prefill -> decode pair of `--pairs` (16->64, 64->16,
16->1), every variant of every pair interleaved in one run:

- `repaged`: the hooked `_send_kvcache_generic` of a request whose decode has
  the other page size, set up as two gpu_planner peers set it up (as
  `tests/integration/sglang/test_page_sizes_mooncake.py`'s Pair does): the
  decode's fetch of the prefill's info through sglang's own
  `try_ensure_parallel_info` (its HTTP answer stubbed), its registration
  through `receive_staging.registration_message_hook` and the request's
  metadata through `page_sizes.send_metadata_hook` +
  `receive_staging.metadata_message_hook`, both parsed by the prefill's hooked
  parsers (`TransferInfo.from_zmq` gives the request virtual pages); one chunk
  (every prefill page), with sglang's slice of the virtual pages. The decode
  is a stand-in manager in this process whose KV buffers are the peer's memory
  (it offers no receive staging: a repaged request is never staged);
- `equal`: the same hooked send at equal page sizes with the same joint runs:
  both sides at the unit page size, the unit pages of the same tokens
  (computed here by a token walk, not by the plugin), item lengths of a unit
  page: the same descriptors;
- `sglang`: sglang's own `_send_kvcache_generic` (unhooked) on those
  equal-page lists.

DeepSeek-like MLA KV: `--buffers` (61) buffers, one per layer, 1,152 bytes per
token (576 bf16 dims), `--tokens` (4,096) sent tokens; each side's pages come
from its own pool (the tokens plus 1,024 spare, rounded up) in runs of
`--run-tokens` (32) tokens and two pages at least, shuffled
(`staged_send.fragmented_pages`): at the defaults about 128 joint runs per
buffer in each pair (fewer where two runs happen to continue each other on
both sides), about 7,800 descriptors of 36 KiB. The plugin runs with its defaults
(`staged_send.plugin_defaults`).

Per pair: each variant's wall time and GIL figures (`bench.send_path.measure_sends`),
descriptors and bytes handed to Mooncake (the plugin's counters; sglang's: its
runs); `joint_runs`, the token walk's runs (one descriptor each per buffer);
`repaged/equal` (the ratio of medians) and `repaged/equal_paired` (the median
of per-round ratios, `harness.paired_ratio`: the headline, target <=
`TARGET_RATIO`). On loopback TCP the wire takes nearly all of a send's time, so
`refused` times the same three sends toward a refusing peer
(`bench.send_path.REFUSING_PEER`, as the send-path benchmarks do: each engine
call stops at Mooncake's segment lookup), interleaved, before the live ones:
this process's own work alone, where the repaged send's extra steps show
(`refused_repaged/equal`, `_paired`); and `repage_cpu_s` times those steps
alone (medians): finding the chunk's request (`PREFILL.chunk_for`), its unit
pages and item lengths (`send._repaged_call`, of which `page_sizes.unit_send`),
the per-token bytes check (`send._check_token_bytes`), and the entries lookup
both sends make (`transfer_entries`); `steps_in_send_s` times every step of the
hook where it runs, in refused repaged and equal sends one after the other
(`steps_in_send`: caches as a run of sends leaves them, where the steps cost
about twice what they cost alone). With `--verify`, each variant first sends once
into cleared peer memory, read back: every sent token's bytes in its decode
slot (a token walk), nothing else (`landed_as_expected`).

Run: `python -m bench.page_sizes [--tokens 4096] [--budget-s 10] [--verify]`;
prints JSON on stdout and two tables on stderr (`table`, `steps_table`). Needs
sglang 0.5.23 and Mooncake 0.3.14.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import gc
import inspect
import json
import math
import os
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import numpy as np

from bench.harness import RepeatPolicy, Stage, measure_interleaved, paired_ratio
from bench.live_submit import LOCALHOST, live_peer
from bench.send_path import REFUSING_PEER, measure_sends
from bench.staged_send import (
    BUFFERS,
    MAX_REPEATS,
    MIN_REPEATS,
    NOTE_PORT,
    RUN_PAGES,
    PeerMemory,
    counted,
    expected_pool,
    fragmented_pages,
    plugin_defaults,
)
from gpu_planner import settings
from gpu_planner.integration.mooncake.engine import (
    QUIET_ENV,
    TCP_ONLY_ENV,
    set_mooncake_defaults,
)

PAIRS = ((16, 64), (64, 16), (16, 1))  # (prefill, decode) page sizes
TOKEN_BYTES = 576 * 2  # one MLA layer's token: 576 bf16 dims
TOKENS = 4096
RUN_TOKENS = 32  # each side's pages come in runs of at least this many tokens (and RUN_PAGES)
SPARE_TOKENS = 1024  # pool tokens no send uses, on each side
VARIANTS = ("repaged", "equal", "sglang")
TARGET_RATIO = 1.2  # repaged / equal (paired), at most
BOOTSTRAP = "127.0.0.1:8998"  # the prefill's bootstrap address as the decode names it
FIRST_ROOM = 1
CPU_POLICY = RepeatPolicy(budget_s=0.2, min_repeats=20, max_repeats=2000)  # `repage_cpu_s`
# The hook's steps `steps_in_send` times (names in `integration/sglang/send.py`), and its calls.
HOOK_STEPS = (
    "_repaged_call", "transfer_entries", "_check_token_bytes", "_plan", "generic_path",
    "_send_direct",
)  # fmt: skip
STEP_CALLS = 200


def run_pages(page_size: int, run_tokens: int = RUN_TOKENS) -> int:
    """Pages per run on a side of `page_size`: `run_tokens` tokens and RUN_PAGES pages at least."""
    return max(RUN_PAGES, -(-run_tokens // page_size))


def pool_tokens(tokens: int, pairs: Sequence[tuple[int, int]], run_tokens: int = RUN_TOKENS) -> int:
    """Tokens of each side's pool: `tokens` + SPARE_TOKENS, in whole runs of every page size."""
    block = math.lcm(*(size * run_pages(size, run_tokens) for pair in pairs for size in pair))
    return -(-(tokens + SPARE_TOKENS) // block) * block


def token_slots(pages: np.ndarray, page_size: int, tokens: int) -> np.ndarray:
    """Each of the first `tokens` tokens' slot in its pool (int64): a token walk of `pages`."""
    walk = np.arange(tokens, dtype=np.int64)
    return pages[walk // page_size].astype(np.int64) * page_size + walk % page_size


def joint_runs(src_slots: np.ndarray, dst_slots: np.ndarray) -> int:
    """Maximal runs of tokens whose slots step by one on both sides."""
    breaks = (np.diff(src_slots) != 1) | (np.diff(dst_slots) != 1)
    return 1 + int(np.count_nonzero(breaks)) if src_slots.size else 0


def route_answer(page_size: int) -> dict[str, Any]:
    """A prefill's bootstrap `/route` answer, as sglang's bootstrap server gives it."""
    return {
        "attn_tp_size": 1,
        "attn_cp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": page_size,
        "kv_cache_dtype": "auto",
        "follow_bootstrap_room": True,
    }


class PeerEngine:
    """What the decode stand-in reads of its engine: its session, the live peer's."""

    def __init__(self, session: str) -> None:
        self.session = session

    def get_session_id(self) -> str:
        return self.session


@contextlib.contextmanager
def no_receive_staging() -> Iterator[None]:
    """The settings loaded with the decode's receive staging off for the block (the decode
    stand-in has no engine to register a region with; a repaged request is never staged)."""
    settings.load({**os.environ, settings.RECEIVE_STAGING_BYTES.name: "0"})
    try:
        yield
    finally:
        settings.load()


class Peers:
    """What every pair shares: this process's engine and KV buffers, the peer's, an executor."""

    def __init__(self, tokens: int, buffers: int, pool: int, peer: tuple[str, int]) -> None:
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            MooncakeTransferEngine,
        )

        self.session, self.peer_address = peer
        self.tokens, self.buffers, self.pool_tokens = tokens, buffers, pool
        self.buffer_bytes = pool * TOKEN_BYTES
        rng = np.random.default_rng(0)
        self.sources = [
            rng.integers(0, 256, self.buffer_bytes, dtype=np.uint8) for _ in range(buffers)
        ]
        self.wrapper = MooncakeTransferEngine(LOCALHOST)
        for source in self.sources:
            self.wrapper.register(source.ctypes.data, source.nbytes)
        self.src_ptrs = [source.ctypes.data for source in self.sources]
        self.dst_ptrs = [self.peer_address + b * self.buffer_bytes for b in range(buffers)]
        self.pool_bytes = buffers * self.buffer_bytes
        self.executor = concurrent.futures.ThreadPoolExecutor(1)  # sglang's, per transfer queue


class PairSends:
    """A prefill of `prefill_page_size` and a decode of `decode_page_size`, connected as two
    gpu_planner peers connect, one request of `peers.tokens` tokens, and its three sends."""

    def __init__(
        self,
        peers: Peers,
        prefill_page_size: int,
        decode_page_size: int,
        room: int,
        run_tokens: int = RUN_TOKENS,
    ) -> None:
        from sglang.srt.disaggregation.mooncake import conn

        from gpu_planner.integration.sglang import page_sizes

        tokens = peers.tokens
        self.peers, self.room = peers, room
        self.prefill_page_size, self.decode_page_size = prefill_page_size, decode_page_size
        self.name = f"{prefill_page_size}->{decode_page_size}"
        self.unit = math.gcd(prefill_page_size, decode_page_size)
        rng = np.random.default_rng(prefill_page_size * 1000 + decode_page_size)
        self.src_pages, self.dst_pages = (
            fragmented_pages(
                rng, peers.pool_tokens // size, tokens // size, run_pages(size, run_tokens)
            ).astype(np.int64)
            for size in (prefill_page_size, decode_page_size)
        )
        self.src_slots = token_slots(self.src_pages, prefill_page_size, tokens)
        self.dst_slots = token_slots(self.dst_pages, decode_page_size, tokens)
        self.joint_runs = joint_runs(self.src_slots, self.dst_slots)
        # The equal send's pages: each unit page of the same tokens, on both sides.
        self.src_units = self.src_slots[:: self.unit] // self.unit
        self.dst_units = self.dst_slots[:: self.unit] // self.unit
        self.prefill = self._prefill_manager(prefill_page_size)
        page_sizes.manager_built_hook(None, self.prefill)
        self.equal = self._prefill_manager(self.unit)  # a prefill of the unit page size
        self.decode = self._decode_manager()
        self._connect()
        self._register()
        self.info = self._parse(self._metadata())
        self.repaged_dst = self.info.dst_kv_indices[: len(self.src_pages)]  # sglang's chunk slice
        if page_sizes.PREFILL.chunk_for(self.repaged_dst) is None:
            raise RuntimeError(
                f"{self.name}: the plugin's parser gave the request no virtual pages"
            )
        self._original = inspect.unwrap(conn.MooncakeKVManager._send_kvcache_generic)
        self._hooked = conn.MooncakeKVManager._send_kvcache_generic

    def _prefill_manager(self, page_size: int) -> Any:
        from sglang.srt.disaggregation.utils import DisaggregationMode

        from bench.sglang_manager import make_manager

        peers = self.peers
        manager = make_manager(
            peers.wrapper, mla=True, kv_data_ptrs=peers.src_ptrs,
            kv_data_lens=[source.nbytes for source in peers.sources],
        )  # fmt: skip
        manager.kv_args.page_size = page_size
        manager.kv_args.kv_item_lens = [page_size * TOKEN_BYTES] * peers.buffers
        manager.disaggregation_mode = DisaggregationMode.PREFILL
        manager.decode_kv_args_table = {}
        return manager

    def _decode_manager(self) -> Any:
        from bench.sglang_manager import make_decode_manager

        peers = self.peers
        decode = make_decode_manager(
            PeerEngine(peers.session), peers.dst_ptrs, [peers.buffer_bytes] * peers.buffers,
            [self.decode_page_size * TOKEN_BYTES] * peers.buffers, self.decode_page_size,
        )  # fmt: skip
        # What sglang's fetch of the prefill's info reads.
        decode.prefill_info_table, decode.kv_cache_dtype_str = {}, "auto"
        decode.kv_args.state_types = []
        decode.attn_tp_size, decode.dcp_size = 1, 1
        decode.kv_layout = decode.dsv41_spec_layout = None
        decode.is_mla_backend, decode.is_hybrid_mla_backend = True, False
        decode._resolve_rank_mapping = lambda info: None
        return decode

    def _connect(self) -> None:
        """sglang's own fetch of the prefill's info (hooked), its HTTP answer stubbed."""
        from sglang.srt.disaggregation.common import conn as common_conn
        from sglang.srt.disaggregation.mooncake import conn

        answer = types.SimpleNamespace(
            status_code=200, json=lambda: route_answer(self.prefill_page_size)
        )
        with mock.patch.object(common_conn.requests, "get", lambda url, timeout: answer):
            connected = conn.MooncakeKVManager.try_ensure_parallel_info(self.decode, BOOTSTRAP)
        if not connected:
            raise RuntimeError(f"{self.name}: the decode did not connect to the prefill")

    def _register(self) -> None:
        """The decode's registration (with its page size), as the prefill parses it."""
        from sglang.srt.disaggregation.mooncake import conn

        from gpu_planner.integration.sglang import page_sizes, receive_staging
        from gpu_planner.integration.sglang.frames import KVRegistration
        from gpu_planner.integration.sglang.staging_wire import SGLANG_REGISTRATION_FRAMES

        peers = self.peers
        frames = KVRegistration(
            endpoint=LOCALHOST, port=NOTE_PORT, session_id=peers.session, ptrs=peers.dst_ptrs,
            item_lens=self.decode.kv_args.kv_item_lens, lens=self.decode.kv_args.kv_data_lens,
            is_device=[False] * peers.buffers,
        ).to_frames()[:SGLANG_REGISTRATION_FRAMES]  # fmt: skip
        with no_receive_staging():
            sent = receive_staging.registration_message_hook(lambda _: frames, self.decode)
        self.registered = conn.KVArgsRegisterInfo.from_zmq(sent)
        self.prefill.decode_kv_args_table[peers.session] = self.registered
        if page_sizes.PREFILL.decode_page_size(peers.session) != self.decode_page_size:
            raise RuntimeError(f"{self.name}: the prefill did not keep the decode's page size")

    def _metadata(self) -> list[bytes]:
        """The decode's metadata for the request, built inside sglang's `send_metadata`."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        from gpu_planner.integration.sglang import page_sizes, receive_staging
        from gpu_planner.integration.sglang.frames import TransferRequest
        from gpu_planner.integration.sglang.page_size_wire import REPAGED_TAG

        decode, room = self.decode, self.room
        decode.request_status[room] = KVPoll.Transferring
        decode.prefill_response_tracker[room] = set()
        decode.required_prefill_response_num_table[room] = 1

        def build(_manager: Any, **kwargs: Any) -> list[bytes]:
            return TransferRequest(
                room=room, endpoint=LOCALHOST, port=NOTE_PORT, session_id=self.peers.session,
                host_pages=kwargs["kv_indices"], decode_prefix_len=kwargs["decode_prefix_len"],
            ).to_frames()  # fmt: skip

        def send_metadata(_receiver: Any) -> list[bytes]:
            return receive_staging.metadata_message_hook(
                build, decode, bootstrap_room=room, required_dst_info_num=1,
                kv_indices=self.dst_pages.astype(np.int32), aux_index=0, state_indices=None,
                decode_prefix_len=0, is_dummy=False, device_kv_indices=None,
            )  # fmt: skip

        receiver = types.SimpleNamespace(bootstrap_addr=BOOTSTRAP)
        frames = page_sizes.send_metadata_hook(send_metadata, receiver)
        if REPAGED_TAG not in frames:
            raise RuntimeError(f"{self.name}: the decode sent its pages in no Repaged frame")
        return frames

    def _parse(self, frames: list[bytes]) -> Any:
        """The prefill's parse of the metadata (hooked: the request gets virtual pages)."""
        from sglang.srt.disaggregation.mooncake import conn

        info = conn.TransferInfo.from_zmq(frames)
        self.prefill.transfer_infos[self.room] = {self.peers.session: info}
        return info

    def _call(
        self, send: Callable, manager: Any, page_size: int, src: Any, dst: Any, session: str
    ) -> int:
        peers = self.peers
        return send(
            manager, session, peers.src_ptrs, peers.dst_ptrs,
            [page_size * TOKEN_BYTES] * peers.buffers, src, dst, peers.executor,
        )  # fmt: skip

    def variants(self, session: str | None = None) -> dict[str, Callable[[], int]]:
        """The three sends toward `session` (None: the live peer)."""
        session = session or self.peers.session
        repaged = (self.prefill, self.prefill_page_size, self.src_pages, self.repaged_dst)
        equal = (self.equal, self.unit, self.src_units, self.dst_units)
        return {
            "repaged": functools.partial(self._call, self._hooked, *repaged, session),
            "equal": functools.partial(self._call, self._hooked, *equal, session),
            "sglang": functools.partial(self._call, self._original, *equal, session),
        }

    def refused_sends(self) -> dict[str, Callable[[], int]]:
        """The three sends toward a refusing peer (`bench.send_path.REFUSING_PEER`): each engine
        call stops at Mooncake's segment lookup, after its binding took the descriptors, so
        their time is this process's own work (planning, hand-off) without the wire's."""
        self.prefill.decode_kv_args_table[REFUSING_PEER] = self.registered  # as for the peer
        sends = self.variants(REFUSING_PEER)
        statuses = {name: send() for name, send in sends.items()}
        if not all(statuses.values()):
            raise RuntimeError(f"{self.name}: statuses {statuses}: the refusing peer took a send")
        return sends

    def counts(self) -> dict[str, dict[str, Any]]:
        """Each send once: its status, descriptors and bytes handed to Mooncake."""
        from gpu_planner.reference import group_runs

        counts = {name: counted(send) for name, send in self.variants().items()}
        runs = len(group_runs(self.src_units.tolist(), self.dst_units.tolist()))
        counts["sglang"].update(  # the plugin counts none of sglang's own: its runs
            descriptors=self.peers.buffers * runs,
            bytes=self.peers.buffers * len(self.src_units) * self.unit * TOKEN_BYTES,
        )
        return counts

    def expected(self) -> np.ndarray:
        """The peer's KV buffers once the request landed: each sent token's bytes in its decode
        slot (a token walk), zeros elsewhere."""
        peers = self.peers
        return expected_pool(
            peers.sources, peers.pool_tokens, self.src_slots, self.dst_slots,
            (TOKEN_BYTES, TOKEN_BYTES), (0, 0), TOKEN_BYTES, 1,
        )  # fmt: skip

    def verify(self, peer: PeerMemory) -> dict[str, bool]:
        """Each send once into cleared peer memory: it lands `expected` and nothing else."""
        expected = self.expected()
        landed = {}
        for name, send in self.variants().items():
            peer.clear()
            status = send()
            landed[name] = status == 0 and np.array_equal(
                peer.read(0, self.peers.pool_bytes), expected
            )
        return landed

    def repage_cpu(self) -> dict[str, float]:
        """The repaged send's own steps, each timed alone (medians, seconds)."""
        from gpu_planner.integration.sglang import page_sizes, send
        from gpu_planner.integration.sglang.entries import SendCall, transfer_entries

        peers = self.peers
        call = SendCall(
            peers.session, peers.src_ptrs, peers.dst_ptrs,
            [self.prefill_page_size * TOKEN_BYTES] * peers.buffers, self.src_pages,
            self.repaged_dst, peers.executor,
        )  # fmt: skip
        found = page_sizes.PREFILL.chunk_for(self.repaged_dst)
        assert found is not None
        route, position = found
        _, chunk, repaged = send._repaged_call(self.prefill, call, route, position)
        entries = transfer_entries(self.prefill, repaged)
        stages = {
            "chunk_for": Stage(lambda: page_sizes.PREFILL.chunk_for(self.repaged_dst)),
            "repaged_call": Stage(lambda: send._repaged_call(self.prefill, call, route, position)),
            "unit_send": Stage(
                lambda: page_sizes.unit_send(
                    route, position, self.src_pages, self.prefill_page_size
                )
            ),
            "transfer_entries": Stage(lambda: transfer_entries(self.prefill, repaged)),
            "check_token_bytes": Stage(
                lambda: send._check_token_bytes(self.prefill, repaged, entries, route, chunk.unit)
            ),
        }
        timings = measure_interleaved(stages, CPU_POLICY)
        return {name: timing.median for name, timing in timings.items()}

    def steps_in_send(self, calls: int = STEP_CALLS) -> dict[str, dict[str, float]]:
        """The repaged and the equal send toward the refusing peer, one after the other `calls`
        times, each step of the hook timed where it runs (after the other send's engine call,
        as in a run of sends: caches as a send finds them): per variant, each step's median,
        the whole send's (`total`) and the median of what the steps leave (`other`), seconds."""
        from gpu_planner.integration.sglang import send as hook

        spent: dict[str, float] = {}

        def timed(name: str, function: Callable) -> Callable:
            def step(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return function(*args, **kwargs)
                finally:
                    spent[name] = spent.get(name, 0.0) + time.perf_counter() - start

            return step

        sends = self.refused_sends()
        samples: dict[str, dict[str, list[float]]] = {"repaged": {}, "equal": {}}
        with contextlib.ExitStack() as patches:
            for name in HOOK_STEPS:
                patches.enter_context(
                    mock.patch.object(hook, name, timed(name, getattr(hook, name)))
                )
            chunk_for = timed("chunk_for", hook.PREFILL.chunk_for)
            patches.enter_context(mock.patch.object(hook.PREFILL, "chunk_for", chunk_for))
            gc.collect()
            gc.disable()
            try:
                for _ in range(calls):
                    for variant, by_step in samples.items():
                        spent.clear()
                        start = time.perf_counter()
                        sends[variant]()
                        total = time.perf_counter() - start
                        for name in ("chunk_for", *HOOK_STEPS):
                            by_step.setdefault(name, []).append(spent.get(name, 0.0))
                        by_step.setdefault("total", []).append(total)
                        by_step.setdefault("other", []).append(total - sum(spent.values()))
            finally:
                gc.enable()
        return {
            variant: {name: float(np.median(values)) for name, values in by_step.items()}
            for variant, by_step in samples.items()
        }

    def close(self) -> None:
        from gpu_planner.integration.sglang import page_sizes

        page_sizes.DECODES.release(self.decode)


def table(result: dict[str, Any]) -> str:
    """A markdown table of a `measure` result: one row per pair, live peer then refusing peer
    (medians [p10-p90]; ratios of medians, paired per round in parentheses)."""
    lines = [
        "| prefill -> decode | unit | descriptors | live `repaged` | live `equal` | live `sglang` "
        "| live repaged/equal | refused `repaged` | refused `equal` | refused `sglang` "
        "| refused repaged/equal | repaged - equal, in send |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(figures: dict[str, Any]) -> str:
        low, median, high = (figures[key] * 1e3 for key in ("p10", "median", "p90"))
        return f"{median:.1f} ms [{low:.1f}-{high:.1f}]"

    def ratio(ratios: dict[str, Any], name: str) -> str:
        paired = ratios[f"{name}_paired"]
        return f"{ratios[name]:.3f} ({'-' if paired is None else f'{paired:.3f}'})"

    for pair in result["pairs"]:
        figures, refused, ratios = pair["figures"], pair["refused"], pair["ratios"]
        in_send = pair["steps_in_send_s"]
        extra_us = (in_send["repaged"]["total"] - in_send["equal"]["total"]) * 1e6
        lines.append(
            f"| {pair['name']} | {pair['unit']} | {figures['repaged']['descriptors']:,} | "
            + " | ".join(cell(figures[variant]) for variant in VARIANTS)
            + f" | {ratio(ratios, 'repaged/equal')} | "
            + " | ".join(cell(refused[variant]) for variant in VARIANTS)
            + f" | {ratio(ratios, 'refused_repaged/equal')} | {extra_us:+.0f} us |"
        )
    lines += ["", steps_table(result)]
    return "\n".join(lines)


def steps_table(result: dict[str, Any]) -> str:
    """The hook's steps in a refused send, repaged / equal (medians, us), one row per pair."""
    names = ("chunk_for", *HOOK_STEPS, "other", "total")
    lines = [
        "| prefill -> decode | " + " | ".join(f"`{name}`" for name in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for pair in result["pairs"]:
        steps = pair["steps_in_send_s"]
        cells = [
            f"{steps['repaged'][name] * 1e6:.1f} / {steps['equal'][name] * 1e6:.1f}"
            for name in names
        ]
        lines.append(f"| {pair['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def measure(
    tokens: int = TOKENS,
    buffers: int = BUFFERS,
    budget_s: float = 10.0,
    verify: bool = False,
    pairs: Sequence[tuple[int, int]] = PAIRS,
    run_tokens: int = RUN_TOKENS,
    refused_budget_s: float = 2.0,
) -> dict[str, Any]:
    """Every pair's three sends of one request of `tokens` tokens of `buffers` buffers,
    interleaved in one run (`budget_s` per send), then toward the refusing peer
    (`refused_budget_s` per send), with their figures."""
    from sglang.srt.plugins import load_plugins

    from gpu_planner.integration.sglang import page_sizes
    from gpu_planner.integration.sglang.prefill_routes import ROUTES

    for page_size in {size for pair in pairs for size in pair}:
        if tokens % page_size:
            raise ValueError(f"{tokens} tokens are not whole pages of {page_size}")
    set_mooncake_defaults(QUIET_ENV, TCP_ONLY_ENV)
    load_plugins()  # the gpu_planner hooks, from the installed entry point
    pool = pool_tokens(tokens, pairs, run_tokens)
    made: list[PairSends] = []
    with plugin_defaults(), live_peer(buffers * pool * TOKEN_BYTES) as peer:
        try:
            peers = Peers(tokens, buffers, pool, peer)
            for index, (prefill_page_size, decode_page_size) in enumerate(pairs):
                room = FIRST_ROOM + index
                made.append(PairSends(peers, prefill_page_size, decode_page_size, room, run_tokens))
            landed = None
            if verify:
                memory = PeerMemory(
                    peers.wrapper, peers.session, peers.peer_address, peers.pool_bytes
                )
                try:
                    landed = {pair.name: pair.verify(memory) for pair in made}
                finally:
                    memory.close()
            counts = {pair.name: pair.counts() for pair in made}
            statuses = {
                f"{name}/{variant}": count["status"]
                for name, by_variant in counts.items()
                for variant, count in by_variant.items()
            }
            if any(statuses.values()):
                raise RuntimeError(f"statuses {statuses}: every send to the live peer must succeed")
            repage_cpu = {pair.name: pair.repage_cpu() for pair in made}
            steps = {pair.name: pair.steps_in_send() for pair in made}
            refused_sends = {
                f"{pair.name}/{variant}": Stage(send)
                for pair in made
                for variant, send in pair.refused_sends().items()
            }
            refused_policy = RepeatPolicy(
                budget_s=refused_budget_s, min_repeats=MIN_REPEATS, max_repeats=MAX_REPEATS
            )
            refused = measure_interleaved(refused_sends, refused_policy)
            sends = {
                f"{pair.name}/{variant}": send
                for pair in made
                for variant, send in pair.variants().items()
            }
            policy = RepeatPolicy(
                budget_s=budget_s, min_repeats=MIN_REPEATS, max_repeats=MAX_REPEATS
            )
            figures = measure_sends(sends, policy, keep_rounds=True)
        finally:
            for pair in made:
                pair.close()
            ROUTES.forget()
            page_sizes.PREFILL.forget()
    results = []
    for pair in made:
        by_variant = {
            variant: {**figures[f"{pair.name}/{variant}"], **counts[pair.name][variant]}
            for variant in VARIANTS
        }
        repaged, equal, sglang = (by_variant[variant] for variant in VARIANTS)
        paired = paired_ratio(repaged["rounds"], equal["rounds"])
        cpu = {variant: refused[f"{pair.name}/{variant}"] for variant in VARIANTS}
        result: dict[str, Any] = {
            "name": pair.name,
            "prefill_page_size": pair.prefill_page_size,
            "decode_page_size": pair.decode_page_size,
            "unit": pair.unit,
            "joint_runs": pair.joint_runs,
            "figures": by_variant,
            "ratios": {
                "repaged/equal": repaged["median"] / equal["median"],
                "repaged/equal_paired": paired,
                "sglang/equal": sglang["median"] / equal["median"],
                "sglang/repaged": sglang["median"] / repaged["median"],
                "sglang/repaged_paired": paired_ratio(sglang["rounds"], repaged["rounds"]),
                "refused_repaged/equal": cpu["repaged"].median / cpu["equal"].median,
                "refused_repaged/equal_paired": paired_ratio(
                    cpu["repaged"].rounds, cpu["equal"].rounds
                ),
                "refused_sglang/repaged": cpu["sglang"].median / cpu["repaged"].median,
            },
            "refused": {
                variant: {**timing.as_dict(), "rounds": [list(sample) for sample in timing.rounds]}
                for variant, timing in cpu.items()
            },
            "repage_cpu_s": repage_cpu[pair.name],
            "steps_in_send_s": steps[pair.name],
            "target_met": paired is not None and paired <= TARGET_RATIO,
        }
        if landed is not None:
            result["landed_as_expected"] = landed[pair.name]
        results.append(result)
    return {
        "tokens": tokens,
        "buffers": buffers,
        "token_bytes": TOKEN_BYTES,
        "run_tokens": run_tokens,
        "pool_tokens": pool,
        "pairs": results,
        "target": {
            "repaged/equal_paired": TARGET_RATIO,
            "met": all(result["target_met"] for result in results),
        },
    }


def _pair(text: str) -> tuple[int, int]:
    prefill, _, decode = text.partition("->")
    return int(prefill), int(decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--buffers", type=int, default=BUFFERS)
    parser.add_argument("--budget-s", type=float, default=10.0, help="per variant and pair")
    parser.add_argument("--run-tokens", type=int, default=RUN_TOKENS)
    parser.add_argument(
        "--pairs", type=_pair, nargs="+", default=list(PAIRS),
        help="prefill->decode page sizes, e.g. 16->64 64->16 16->1",
    )  # fmt: skip
    parser.add_argument(
        "--refused-budget-s", type=float, default=2.0, help="per variant and pair, refusing peer"
    )
    parser.add_argument("--verify", action="store_true", help="check what lands, first")
    args = parser.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    result = measure(
        args.tokens, args.buffers, args.budget_s, args.verify, args.pairs, args.run_tokens,
        args.refused_budget_s,
    )  # fmt: skip
    print(json.dumps(result, indent=1))
    print(table(result), file=sys.stderr)


if __name__ == "__main__":
    main()

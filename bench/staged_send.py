"""Fragmented generic sends to a live peer: sglang's, the hook's direct and staged, and the one
the plugin's defaults choose.

A live peer engine in another process (`bench.live_submit.live_peer`, TCP on
127.0.0.1) takes every byte. DeepSeek-like MLA KV: `--buffers` (61) buffers,
one per layer, page size 16, 576 dims of bf16 per token (18,432 bytes per
page), real source buffers of random bytes; `--pages` (256: 4k tokens) pages
on each side in runs of two pages, shuffled, so about 128 runs per buffer
(61 x 128 = 7,808 descriptors at the default). The plugin runs with its
defaults (the gate's knobs unset for the run, 128 MiB of send slots: 32 MiB
slots). Variants, interleaved:

- `sglang`: sglang's own `_send_kvcache_generic` (unhooked), into the peer's
  KV buffers;
- `hook`: the plugin's hooked send toward a decode that offered no receive
  staging (the direct path: merged runs, arrays hand-off);
- `staged`: the hooked send toward a decode that advertised receive staging
  (a second part of the peer's registered region) and lent the request a
  part (`staging_wire.Reservation`, parsed by the hooked
  `TransferInfo.from_zmq`), staged whatever it costs (`path_cost.deciding` a
  gate that stages every send): each slot-sized piece of pages of every
  buffer is gathered into the prefill's send slots and written with one
  descriptor;
- `chosen`: the same hooked send toward the same decode with the plugin's
  defaults: the cost model (`path_cost`, its own instance, learning from this
  variant's sends only) picks direct or staged per send. `chosen_path` is the
  path most of its timed sends took, `figures.chosen.paths` how many took each;
- `wire` (a reference, not a send): the staged send's engine calls alone,
  each piece written from one slot without a gather: what its bytes cost on
  this wire;
- `scatter`: what the decode does next, timed on this machine (in production
  the peer's process runs it): the `Staged` note's chunks scattered
  (`chunk_scatter_layout`, `scatter_head_slices`) from a host buffer of the
  reservation's size into host KV buffers of the decode's sizes, by the
  request's pages, as `receive_staging.ReceiveRegion` does.

Per variant: wall time (`bench.harness`), GIL holds and waits (`bench.gil`,
through `bench.send_path.measure_sends`), descriptors and bytes handed to
Mooncake (the plugin's counters; sglang's: its runs); `staged_with_scatter_s`
(the staged send's median plus the scatter's), `chosen_with_scatter_s` (the
median of the chosen sends, each with the scatter's median where it staged;
`chosen_with_scatter_p10_p90_s` their 10th and 90th percentiles)
and the ratios to them; the
`_paired` ratios are medians of per-round ratios (`harness.paired_ratio`: two
variants timed in one round ran one right after the other), steadier than the
ratio of medians where a slow send leaves few samples, and each variant's
`rounds` holds its (round, seconds) samples. With
`--verify`, each variant first sends once into cleared peer memory, read back
(staged: its staging scattered here), which must hold the source pages at the
destination pages and nothing else (`landed_as_expected`).
Run: `python -m bench.staged_send [--pages 256] [--budget-s 10] [--verify]`;
prints JSON. Needs sglang 0.5.23 and Mooncake 0.3.14.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import inspect
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from bench.harness import RepeatPolicy, paired_ratio
from bench.live_submit import LOCALHOST, live_peer
from bench.send_path import GIL_CALLS, measure_sends
from gpu_planner import settings
from gpu_planner.integration.mooncake.engine import (
    QUIET_ENV,
    TCP_ONLY_ENV,
    set_mooncake_defaults,
)
from gpu_planner.integration.sglang.path_cost import (
    DIRECT,
    STAGED,
    Choice,
    Figures,
    Gate,
    PathCosts,
    deciding,
)

PAGE_SIZE = 16
ITEM_LEN = PAGE_SIZE * 576 * 2  # one MLA layer's page: 16 tokens of 576 bf16 dims (the default)
BUFFERS = 61
SPARE_PAGES = 16  # pool pages no send uses
RUN_PAGES = 2
NOTE_PORT = 17000  # where the staged note would go (the bench keeps it)
ROOM, RESERVATION_ID = 1, 1
GATE_KNOBS = (settings.STAGING_MIN_DESCRIPTORS.name, settings.STAGING_MAX_MEAN_BYTES.name)
STAGE_EVERY_SEND = Gate(min_descriptors=1, max_mean_bytes=1 << 40)  # the `staged` variant's
VARIANTS = ("sglang", "hook", "staged", "chosen")
TARGET_RATIO, TARGET_DESCRIPTORS = 10.0, 1000  # staged (with scatter) vs hook, from the issue
MIN_REPEATS = 5  # samples per variant at least, interleaved: the wire is noisy on a shared machine
# and at most: a sub-millisecond send's time spreads +-30% here, so a 5% difference between
# variants needs hundreds of samples (the budget stops the large sends long before).
MAX_REPEATS = 400


def fragmented_pages(
    rng: np.random.Generator, pool_pages: int, count: int, run_pages: int = RUN_PAGES
) -> np.ndarray:
    """`count` distinct pages of a `pool_pages` pool in runs of `run_pages`, shuffled (int32)."""
    runs = rng.permutation(pool_pages // run_pages)[: -(-count // run_pages)]
    pages = (runs[:, None] * run_pages + np.arange(run_pages)).reshape(-1)
    return pages[:count].astype(np.int32)


@contextlib.contextmanager
def plugin_defaults() -> Iterator[None]:
    """gpu_planner's settings as a user's environment gives them, but the gate's knobs unset
    (the cost model decides), loaded for the block; the environment and settings come back."""
    saved = {name: os.environ.pop(name) for name in GATE_KNOBS if name in os.environ}
    try:
        settings.forget_loaded()
        settings.load()
        yield
    finally:
        os.environ.update(saved)
        settings.forget_loaded()
        settings.load()


class CountedCosts(PathCosts):
    """A cost model that keeps the path each send it priced took, in order (the `chosen`
    variant's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.history: list[str] = []

    def taken(self, peer: str, choice: Choice, path: str) -> None:
        self.history.append(path)
        super().taken(peer, choice, path)


@contextlib.contextmanager
def offered(session: str, capability: Any) -> Iterator[None]:
    """Decode `session` advertising `capability` to this process for the block (None: nothing).

    Stands for the decode's registration (with or without the capability
    frames) having been parsed last; what it was before comes back after.
    """
    from gpu_planner.integration.sglang.prefill_routes import ROUTES

    saved = ROUTES.capability(session)
    ROUTES.advertised(session, capability)
    try:
        yield
    finally:
        ROUTES.advertised(session, saved)


@dataclasses.dataclass(frozen=True)
class DecodeOffer:
    """A decode's receive staging and one request's lent part, as this prefill parsed them."""

    capability: Any  # staging_wire.Capability
    reservation: Any  # staging_wire.Reservation
    info: Any  # sglang's TransferInfo: its dst_kv_indices are the route's pages


def offer_receive_staging(
    manager: Any,
    session: str,
    dst: tuple[Sequence[int], Sequence[int], Sequence[int]],
    region: tuple[int, int],
    dst_pages: np.ndarray,
    tp: tuple[int, int] = (0, 1),
) -> DecodeOffer:
    """Register decode `session` with `manager` and lend its request a part of `region`.

    `dst` is the decode's KV buffers (addresses, item lengths, registered
    bytes), `region` its receive staging (address, bytes), `tp` its (rank,
    attention TP size). Both messages go through sglang's parsers with the
    plugin's hooks, as they arrive from a gpu_planner decode: the
    registration with the capability frames, the request's metadata (pages
    `dst_pages`) with a reservation of the region's start. Raises unless the
    hooks kept both.
    """
    from sglang.srt.disaggregation.mooncake import conn

    from gpu_planner.integration.sglang.frames import KVRegistration, TransferRequest
    from gpu_planner.integration.sglang.prefill_routes import ROUTES
    from gpu_planner.integration.sglang.staging_wire import (
        SGLANG_REGISTRATION_FRAMES,
        Capability,
        Reservation,
    )

    ptrs, item_lens, lens = (list(map(int, column)) for column in dst)
    capability = Capability(*region)
    registration = KVRegistration(
        endpoint=LOCALHOST, port=NOTE_PORT, session_id=session, ptrs=ptrs, item_lens=item_lens,
        lens=lens, is_device=[False] * len(ptrs), tp_rank=tp[0], attn_tp_size=tp[1],
    ).to_frames()[:SGLANG_REGISTRATION_FRAMES]  # fmt: skip
    decode = conn.KVArgsRegisterInfo.from_zmq([*registration, *capability.frames()])
    manager.decode_kv_args_table = {session: decode}  # as sglang's bootstrap thread keeps it
    num_pages = len(dst_pages)
    reservation = Reservation(RESERVATION_ID, 0, num_pages * sum(item_lens), num_pages)
    metadata = TransferRequest(
        room=ROOM, endpoint=LOCALHOST, port=NOTE_PORT, session_id=session, host_pages=dst_pages
    ).to_frames()
    info = conn.TransferInfo.from_zmq([*metadata, *reservation.frames()])
    if ROUTES.capability(session) != capability or ROUTES.route_for(info.dst_kv_indices) is None:
        raise RuntimeError("the plugin's parser hooks did not keep the decode's receive staging")
    return DecodeOffer(capability, reservation, info)


class DecodeScatter:
    """The decode's scatter of a staged send, in host memory of this process.

    `staging` is a buffer of the reservation's size, `pool` the decode's KV
    buffers (`pool_pages` pages of each of `item_lens`, one after another);
    `note` (the prefill's `Staged` note, set before a call) names the chunks.
    A call scatters them as `ReceiveRegion._scatter` does: one
    `chunk_scatter_layout` and one `scatter_head_slices` per chunk.
    """

    def __init__(
        self, item_lens: Sequence[int], pool_pages: int, page_size: int, dst_pages: np.ndarray
    ) -> None:
        self.item_lens = [int(item_len) for item_len in item_lens]
        self.page_size = page_size
        self.page_bytes = sum(self.item_lens)
        self.pages = np.array(dst_pages, dtype=np.int64)  # as the decode keeps them
        self.staging = np.zeros(len(self.pages) * self.page_bytes, dtype=np.uint8)
        self.lens = [pool_pages * item_len for item_len in self.item_lens]
        self.pool = np.zeros(sum(self.lens), dtype=np.uint8)
        starts = np.cumsum([0, *self.lens[:-1]]).tolist()
        self.ptrs = [self.pool.ctypes.data + start for start in starts]
        self.note: Any = None

    def __call__(self) -> None:
        from gpu_planner.head_scatter import scatter_head_slices
        from gpu_planner.integration.sglang.receive_staging import chunk_scatter_layout
        from gpu_planner.integration.sglang.staging_wire import chunk_offset, writer_part

        note = self.note
        entries = note.entries.tolist()
        dst_ptrs = tuple(self.ptrs[entry] for entry in entries)
        page_lens = tuple(self.item_lens[entry] for entry in entries)
        dst_lens = [self.lens[entry] for entry in entries]
        part, _ = writer_part(self.staging.size, note.writers, note.writer)
        for start, count in note.chunks.tolist():
            layout = chunk_scatter_layout(
                dst_ptrs, page_lens, self.page_size, note.writers, note.writer, count
            )
            base = part + chunk_offset(self.page_bytes, note.writers, start)
            scatter_head_slices(
                layout, self.pages[start : start + count], self.staging[base:], dst_lens,
                dst_is_device=note.is_device,
            )  # fmt: skip


class PeerMemory:
    """The live peer's registered memory, cleared and read back through a Mooncake engine."""

    def __init__(self, wrapper: Any, session: str, address: int, nbytes: int) -> None:
        self._wrapper, self._session, self.address = wrapper, session, address
        self._engine = wrapper.engine
        self._local = np.zeros(nbytes, dtype=np.uint8)
        wrapper.register(self._local.ctypes.data, nbytes)

    def close(self) -> None:
        """Deregister the local buffer (before it is freed)."""
        self._wrapper.deregister(self._local.ctypes.data)

    def clear(self) -> None:
        self._local[:] = 0
        self._transfer(self._engine.transfer_sync_write, 0, self._local.size)

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        self._transfer(self._engine.transfer_sync_read, offset, nbytes)
        return self._local[offset : offset + nbytes].copy()

    def _transfer(self, transfer: Callable[..., int], offset: int, nbytes: int) -> None:
        local = self._local.ctypes.data + offset
        status = transfer(self._session, local, self.address + offset, nbytes)
        if status != 0:
            raise RuntimeError(f"reading or clearing the peer's memory failed ({status})")


def expected_pool(
    sources: Sequence[np.ndarray],
    pool_pages: int,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    token_lens: tuple[int, int],
    head_offsets: tuple[int, int],
    slice_len: int,
    page_size: int,
) -> np.ndarray:
    """The decode's KV buffers (one after another) once a send landed: zeros elsewhere.

    Each buffer's destination page `dst_pages[i]`, token slot `t`, holds
    `slice_len` bytes at `head_offsets[1]` of `token_lens[1]`-byte slots, from
    source page `src_pages[i]`'s slot `t` at `head_offsets[0]` (whole pages:
    one slot of the page's bytes, offsets 0).
    """
    src_token, dst_token = token_lens
    pools = []
    for source in sources:
        pool = np.zeros((pool_pages, page_size, dst_token), dtype=np.uint8)
        pages = source.reshape(-1, page_size, src_token)[src_pages]
        dst_slice = slice(head_offsets[1], head_offsets[1] + slice_len)
        pool[dst_pages, :, dst_slice] = pages[:, :, head_offsets[0] : head_offsets[0] + slice_len]
        pools.append(pool.reshape(-1))
    return np.concatenate(pools)


def counted(send: Callable[[], int]) -> dict[str, Any]:
    """One call of `send`: its status, and the descriptors and bytes the plugin counted."""
    from gpu_planner.integration.sglang import counters

    before = counters.snapshot()
    status = send()
    after = counters.snapshot()
    sends = {
        path: count - before["sends"].get(path, 0)
        for path, count in after["sends"].items()
        if count != before["sends"].get(path, 0)
    }
    return {
        "status": status,
        "sends": sends,  # the plugin's paths taken (hook/hand-off): none for sglang's own
        "descriptors": after["descriptors"] - before["descriptors"],
        "bytes": after["bytes"] - before["bytes"],
    }


class StagedSendBench:
    """The three generic sends to one live peer, on one MLA manager, and the decode's scatter."""

    def __init__(
        self, num_pages: int, buffers: int, peer: tuple[str, int], item_len: int = ITEM_LEN
    ) -> None:
        from sglang.srt.disaggregation.mooncake import conn
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            MooncakeTransferEngine,
        )
        from sglang.srt.plugins import load_plugins

        from bench.sglang_manager import make_manager
        from gpu_planner.integration.sglang import send_slots

        load_plugins()  # the gpu_planner hooks, from the installed entry point
        self.session, peer_address = peer
        self.num_pages, self.buffers, self.item_len = num_pages, buffers, item_len
        self.pool_pages = num_pages + SPARE_PAGES + num_pages % RUN_PAGES
        rng = np.random.default_rng(0)
        self.sources = [
            rng.integers(0, 256, self.pool_pages * item_len, dtype=np.uint8) for _ in range(buffers)
        ]
        self.wrapper = MooncakeTransferEngine(LOCALHOST)
        for source in self.sources:
            self.wrapper.register(source.ctypes.data, source.nbytes)
        self.src_pages = fragmented_pages(rng, self.pool_pages, num_pages)
        self.dst_pages = fragmented_pages(rng, self.pool_pages, num_pages)
        self.src_ptrs = [source.ctypes.data for source in self.sources]
        buffer_bytes = self.pool_pages * item_len
        self.pool_bytes = buffers * buffer_bytes
        self.dst_ptrs = [peer_address + buffer * buffer_bytes for buffer in range(buffers)]
        self.item_lens = [item_len] * buffers
        self.manager = make_manager(
            self.wrapper, mla=True, kv_data_ptrs=self.src_ptrs,
            kv_data_lens=[source.nbytes for source in self.sources],
        )  # fmt: skip
        self.slots = send_slots.SEND_SLOTS.get(self.manager)  # registered now (default 128 MiB)
        if isinstance(self.slots, str):
            raise RuntimeError(f"no send slots: {self.slots}")
        self.offer = offer_receive_staging(
            self.manager,
            self.session,
            (self.dst_ptrs, self.item_lens, [buffer_bytes] * buffers),
            (peer_address + self.pool_bytes, num_pages * buffers * item_len),
            self.dst_pages,
        )
        self.staged_dst_pages = self.offer.info.dst_kv_indices[:num_pages]  # sglang's chunk slice
        self.scatter = DecodeScatter(self.item_lens, self.pool_pages, PAGE_SIZE, self.dst_pages)
        self.manager._send_multipart_locked = self._keep_note
        self._original = inspect.unwrap(conn.MooncakeKVManager._send_kvcache_generic)
        self._hooked = conn.MooncakeKVManager._send_kvcache_generic
        self.peer_address = peer_address
        self.stage_every_send = PathCosts(Figures.seeded(), gate=STAGE_EVERY_SEND)
        self.chosen_costs = CountedCosts.from_settings()  # the plugin's defaults, its own state
        self.executor = concurrent.futures.ThreadPoolExecutor(1)  # sglang's, per transfer queue

    def _keep_note(self, _endpoint: str, frames: list[bytes], is_ipv6: bool = False) -> None:
        """The prefill's `Staged` note, kept for the scatter instead of sent on ZMQ."""
        from gpu_planner.integration.sglang.staging_wire import Staged

        self.scatter.note = Staged.from_frames(frames)

    def _send(
        self, send: Callable, dst_pages: np.ndarray, capability: Any, costs: PathCosts
    ) -> int:
        """One variant's send, in the same scaffolding as every other's (what the decode
        offered, the model that decides): its Python costs the same in each, none of it in
        the comparison."""
        with offered(self.session, capability), deciding(costs):
            return send(
                self.manager, self.session, self.src_ptrs, self.dst_ptrs, self.item_lens,
                self.src_pages, dst_pages, self.executor,
            )  # fmt: skip

    def send_sglang(self) -> int:
        return self._send(self._original, self.dst_pages, None, self.chosen_costs)

    def send_hook(self) -> int:
        return self._send(self._hooked, self.dst_pages, None, self.chosen_costs)

    def send_staged(self) -> int:
        capability = self.offer.capability
        return self._send(self._hooked, self.staged_dst_pages, capability, self.stage_every_send)

    def send_chosen(self) -> int:
        capability = self.offer.capability
        return self._send(self._hooked, self.staged_dst_pages, capability, self.chosen_costs)

    def variants(self) -> dict[str, Callable[[], int]]:
        return {
            "sglang": self.send_sglang,
            "hook": self.send_hook,
            "staged": self.send_staged,
            "chosen": self.send_chosen,
        }

    def wire_only(self) -> int:
        """The staged send's engine calls alone: each piece written from one slot, no gather."""
        from gpu_planner.integration.sglang.staging_wire import chunk_offset

        write = self.wrapper.engine.batch_transfer_sync_write_arrays
        page_bytes = self.buffers * self.item_len
        src = np.array([self.slots.slot(0).data_ptr()], dtype=np.int64)
        for start, count in self.scatter.note.chunks.tolist():
            dst = self.offer.capability.address + chunk_offset(page_bytes, 1, start)
            lens = np.array([count * page_bytes], dtype=np.int64)
            status = write(self.session, src, np.array([dst], dtype=np.int64), lens)
            if status != 0:
                return status
        return 0

    def counts(self) -> dict[str, dict[str, Any]]:
        """Each send once: its status, descriptors and bytes handed to Mooncake."""
        from gpu_planner.reference import group_runs

        counts = {name: counted(send) for name, send in self.variants().items()}
        runs = len(group_runs(self.src_pages.tolist(), self.dst_pages.tolist()))
        counts["sglang"].update(  # the plugin counts none of sglang's own: its runs
            descriptors=self.buffers * runs, bytes=self.buffers * self.num_pages * self.item_len
        )
        counts["staged"]["chunks"] = len(self.scatter.note.chunks)
        return counts

    def verify(self) -> dict[str, bool]:
        """Each send once into cleared peer memory: the peer's pages hold the source pages."""
        expected = expected_pool(
            self.sources, self.pool_pages, self.src_pages, self.dst_pages,
            (self.item_len, self.item_len), (0, 0), self.item_len, 1,
        )  # fmt: skip
        reservation = self.offer.reservation.nbytes
        peer = PeerMemory(
            self.wrapper, self.session, self.peer_address, self.pool_bytes + reservation
        )
        try:
            return {
                name: self._lands(peer, send, expected) for name, send in self.variants().items()
            }
        finally:
            peer.close()

    def _lands(self, peer: PeerMemory, send: Callable[[], int], expected: np.ndarray) -> bool:
        """Whether `send`, into cleared peer memory, lands `expected` (staged: once scattered)."""
        peer.clear()
        sent = counted(send)
        pool = peer.read(0, self.pool_bytes)
        if any(path.startswith("staged/") for path in sent["sends"]):
            if pool.any():
                return False  # a staged send writes the staging region only
            self.scatter.staging[:] = peer.read(self.pool_bytes, self.offer.reservation.nbytes)
            self.scatter.pool[:] = 0
            self.scatter()
            pool = self.scatter.pool
        return sent["status"] == 0 and np.array_equal(pool, expected)


def measure(
    num_pages: int = 256,
    buffers: int = BUFFERS,
    budget_s: float = 10.0,
    verify: bool = False,
    item_len: int = ITEM_LEN,
) -> dict[str, Any]:
    """Every variant's figures for one fragmented send of `num_pages` pages of `buffers` buffers
    of `item_len` bytes per page."""
    from gpu_planner.integration.sglang.prefill_routes import ROUTES

    set_mooncake_defaults(QUIET_ENV, TCP_ONLY_ENV)
    pool_pages = num_pages + SPARE_PAGES + num_pages % RUN_PAGES
    peer_bytes = buffers * (pool_pages + num_pages) * item_len  # the KV pool, then the region
    with plugin_defaults(), live_peer(peer_bytes) as peer:
        try:
            bench = StagedSendBench(num_pages, buffers, peer, item_len)
            landed = bench.verify() if verify else None
            counts = bench.counts()
            statuses = {name: count["status"] for name, count in counts.items()}
            if any(statuses.values()):
                raise RuntimeError(f"statuses {statuses}: every send to the live peer must succeed")
            stages: dict[str, Callable[[], Any]] = {
                **bench.variants(),
                "scatter": bench.scatter,
                "wire": bench.wire_only,
            }
            policy = RepeatPolicy(
                budget_s=budget_s, min_repeats=MIN_REPEATS, max_repeats=MAX_REPEATS
            )
            history = bench.chosen_costs.history
            before = len(history)
            figures = measure_sends(stages, policy, keep_rounds=True)
            paths = {path: history[before:].count(path) for path in (DIRECT, STAGED)}
            timed_paths = _timed_paths(history, figures["chosen"]["repeats"])
            slot_bytes = bench.slots.slot_bytes
            model = bench.chosen_costs.figures(bench.session)
        finally:
            ROUTES.forget()
    for name in VARIANTS:
        figures[name].update(counts[name])
    figures["chosen"]["paths"] = paths  # its timed and GIL-watched sends, by path taken
    chosen_path = STAGED if paths[STAGED] > paths[DIRECT] else DIRECT
    staged_s, scatter_s = figures["staged"]["median"], figures["scatter"]["median"]
    with_scatter = staged_s + scatter_s
    # Each timed chosen send with the decode's scatter where it staged (the paths may mix).
    chosen_rounds = [
        (index, seconds + (scatter_s if path == STAGED else 0.0))
        for (index, seconds), path in zip(figures["chosen"]["rounds"], timed_paths, strict=True)
    ]
    chosen_samples = [seconds for _, seconds in chosen_rounds]
    chosen_with_scatter = float(np.median(chosen_samples))
    hook_s, sglang_s = figures["hook"]["median"], figures["sglang"]["median"]
    fastest_s = min(hook_s, with_scatter)
    result: dict[str, Any] = {
        "pages": num_pages,
        "tokens": num_pages * PAGE_SIZE,
        "buffers": buffers,
        "page_size": PAGE_SIZE,
        "item_len": item_len,
        "descriptors": counts["hook"]["descriptors"],
        "mean_descriptor_bytes": counts["hook"]["bytes"] / counts["hook"]["descriptors"],
        "slot_bytes": slot_bytes,
        "figures": figures,
        "chosen_path": chosen_path,
        "faster_path": DIRECT if hook_s <= with_scatter else STAGED,
        "staged_wall_s": staged_s,
        "scatter_s": scatter_s,
        "staged_with_scatter_s": with_scatter,
        "chosen_with_scatter_s": chosen_with_scatter,
        "chosen_with_scatter_p10_p90_s": [
            float(np.percentile(chosen_samples, 10)),
            float(np.percentile(chosen_samples, 90)),
        ],
        "model": {  # the chosen variant's figures for this peer once the run ended
            "direct_s": model.direct_s(counts["hook"]["descriptors"], counts["hook"]["bytes"]),
            "staged_s": model.staged_s(len(bench.scatter.note.chunks), counts["hook"]["bytes"]),
            "figures": dataclasses.asdict(model),
        },
        "ratios": {
            "sglang/hook": sglang_s / hook_s,
            "hook/staged": hook_s / staged_s,
            "hook/staged_with_scatter": hook_s / with_scatter,
            "sglang/staged_with_scatter": sglang_s / with_scatter,
            "chosen/fastest": chosen_with_scatter / fastest_s,
            "sglang/chosen": sglang_s / chosen_with_scatter,
            "sglang/chosen_paired": paired_ratio(figures["sglang"]["rounds"], chosen_rounds),
            "sglang/hook_paired": paired_ratio(
                figures["sglang"]["rounds"], figures["hook"]["rounds"]
            ),
            "chosen/wire": chosen_with_scatter / figures["wire"]["median"],
        },
        "target": {
            "hook/staged_with_scatter": TARGET_RATIO,
            "descriptors": TARGET_DESCRIPTORS,
            "met": counts["hook"]["descriptors"] >= TARGET_DESCRIPTORS
            and hook_s / with_scatter >= TARGET_RATIO,
        },
    }
    if landed is not None:
        result["landed_as_expected"] = landed
    return result


def _timed_paths(history: list[str], repeats: int) -> list[str]:
    """The paths of the chosen variant's timed sends: the `repeats` choices right before its
    GIL-watched ones (`measure_sends`: as many as were timed, `GIL_CALLS` at most)."""
    watched = min(repeats, GIL_CALLS)
    timed = history[len(history) - watched - repeats : len(history) - watched]
    if len(timed) != repeats:
        raise RuntimeError(f"{len(history)} choices for {repeats} timed chosen sends")
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--buffers", type=int, default=BUFFERS)
    parser.add_argument("--budget-s", type=float, default=10.0, help="per variant")
    parser.add_argument("--verify", action="store_true", help="check what lands, first")
    parser.add_argument(
        "--item-lens", type=int, nargs="+", default=[ITEM_LEN],
        help="bytes per page of each buffer; several: one run each (where staging starts to pay)",
    )  # fmt: skip
    args = parser.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    results = [
        measure(args.pages, args.buffers, args.budget_s, args.verify, item_len)
        for item_len in args.item_lens
    ]
    print(json.dumps(results[0] if len(results) == 1 else results, indent=1))


if __name__ == "__main__":
    main()

"""Receive staging through two real Mooncake engines: the bytes sglang's own send lands.

The prefill side is a real `MooncakeKVManager` (`make_manager`) sending with
sglang's `MooncakeTransferEngine` over TCP on 127.0.0.1; the decode side is a
real `MooncakeKVManager` holding the state its status handling reads, with a
registered KV pool and the plugin's receive staging. Messages go between them
as sglang's parsers and the plugin's hooks see them: the decode's
registration and request metadata (with the capability and reservation
frames) through the hooked `from_zmq` parsers, the prefill's staged note
through the hooked `handle_chunk_ready`, its status through the hooked
`apply_prefill_status`. After the status, the decode's pool must hold exactly
what sglang's `_send_kvcache_generic` (unhooked) lands, for MHA and for
HiSparse's two destination spaces.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import threading
import time

import numpy as np
import pytest
from sglang_plugin_support import (
    ORIGINALS,
    KVPool,
    conn,
    deliver_status,
    hooked_metadata,
    hooked_send,
    make_decode_manager,
    make_manager,
    registration_frames,
)
from suite_support import set_knob

from gpu_planner import settings
from gpu_planner.integration.sglang import (
    adapter,
    counters,
    path_cost,
    prefill_routes,
    receive_staging,
    send_path,
    send_slots,
    staged_send,
)
from gpu_planner.integration.sglang.frames import TransferRequest
from gpu_planner.integration.sglang.staging_wire import STAGED_TAG
from gpu_planner.kernels import interpreter_enabled

POOL_PAGES = 128
PAGE_SIZE = 4
KV_POLL_TRANSFERRING, KV_POLL_SUCCESS, KV_POLL_FAILED = 3, 4, 0
# sglang's executor per transfer queue on a small host: one thread (4 threads, 4 queues)
SEND_EXECUTOR = concurrent.futures.ThreadPoolExecutor(1)
DEAD_SESSION = "127.0.0.1:9"  # nothing listens there: Mooncake's call fails at once


def kv_pool(engine, item_lens: list[int], seed: int | None) -> KVPool:
    """POOL_PAGES pages per buffer, registered: random bytes from `seed`, or zeros (None)."""
    fill = "zeros" if seed is None else "random"
    return KVPool(engine, item_lens, fill, seed or 0, pages=POOL_PAGES)


def decode_manager(engine, pool: KVPool, device_buffers: int = 0) -> conn.MooncakeKVManager:
    """A real decode-side manager over `pool` (`bench.sglang_manager.make_decode_manager`);
    with HiSparse pages its last `device_buffers` buffers take the device pages."""
    return make_decode_manager(
        engine, pool.ptrs, pool.lens, pool.item_lens, PAGE_SIZE, num_draft_entries=device_buffers
    )


def fragmented(rng: np.random.Generator, count: int, dtype=np.int32) -> np.ndarray:
    """`count` distinct pool pages in runs of about two, shuffled."""
    runs = np.arange(POOL_PAGES).reshape(-1, 2)[rng.permutation(POOL_PAGES // 2)]
    return runs.reshape(-1)[:count].astype(dtype)


def all_slots_back(staging: send_slots.SendSlots, held: int = 0, within_s: float = 60.0) -> bool:
    """Whether every send slot is free but `held` (a write that failed read them: held), once
    the engine calls still reading one end: a failed send returns at its first failed piece,
    as sglang's sends do, and a piece still on the wire gives its slot back when its call ends."""
    deadline = time.monotonic() + within_s
    while (staging.free_slots, staging.held_slots) != (send_slots.SLOTS - held, held):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


class Deployment:
    """One prefill and one decode manager, connected as sglang connects them."""

    def __init__(
        self, engines, item_lens: list[int], device_buffers: int, seed: int, place=None
    ) -> None:
        prefill_engine, decode_engine = engines
        self.source = kv_pool(prefill_engine, item_lens, seed)
        self.destination = kv_pool(decode_engine, item_lens, None)
        if place is not None:  # both sides' KV stands for a GPU's: device slots and region
            place(self.source)
            place(self.destination)
        self.decode = decode_manager(decode_engine, self.destination, device_buffers)
        self.prefill = make_manager(
            prefill_engine, kv_data_ptrs=self.source.ptrs, kv_data_lens=self.source.lens
        )
        self.session = decode_engine.session_id
        self.device_ptrs = set(self.destination.ptrs[len(item_lens) - device_buffers :])
        self.notes: list[list[bytes]] = []
        self.prefill._send_multipart_locked = lambda _, parts, is_ipv6=False: self.notes.append(
            parts
        )
        self.prefill.decode_kv_args_table = {}
        self._register()

    def _register(self) -> None:
        frames = registration_frames(self.destination, self.session)
        info = conn.KVArgsRegisterInfo.from_zmq(self._advertise(frames))
        self.prefill.decode_kv_args_table[self.session] = info

    def _advertise(self, frames: list[bytes]) -> list[bytes]:
        """What the hooked registration message adds to sglang's frames on this decode."""
        return receive_staging.registration_message_hook(lambda _: frames, self.decode)

    def request(self, room: int, host_pages: np.ndarray, device_pages: np.ndarray | None):
        """The decode's metadata for `room` as the prefill parses it (hooked parsers)."""
        self.decode.request_status[room] = KV_POLL_TRANSFERRING
        self.decode.prefill_response_tracker[room] = set()
        self.decode.required_prefill_response_num_table[room] = 1
        frames = hooked_metadata(self.decode, room, self.session, host_pages, device_pages)
        info = conn.TransferInfo.from_zmq(frames)
        self.prefill.transfer_infos[room] = {self.session: info}  # as sglang's bootstrap keeps it
        return info

    def send(self, info, src_pages: np.ndarray, pages: slice, session: str | None = None) -> int:
        device = info.dst_device_kv_indices
        return hooked_send()(
            self.prefill,
            mooncake_session_id=session or self.session,
            src_data_ptrs=self.source.ptrs,
            dst_data_ptrs=self.destination.ptrs,
            item_lens=self.source.item_lens,
            prefill_data_indices=src_pages[pages],
            dst_data_indices=info.dst_kv_indices[pages],
            executor=SEND_EXECUTOR,
            dst_device_data_indices=None if device is None else device[pages],
            dst_device_data_ptrs=self.device_ptrs or None,
        )

    def deliver(self, room: int, status: int = KV_POLL_SUCCESS) -> None:
        """The prefill's notes, then its status, through the decode's hooked handlers."""
        for note in self.notes:  # as sglang's decode thread: a chunk message, else a status
            if not conn.MooncakeKVManager.handle_chunk_ready(self.decode, note):
                assert conn.MooncakeKVManager.parse_kv_status_message(self.decode, note) is None
        self.notes.clear()
        deliver_status(self.prefill, self.decode, room, status)

    def sglang_bytes(self, src_pages, host_pages, device_pages) -> np.ndarray:
        """What sglang's own send lands in a fresh copy of the decode's pool."""
        reference = kv_pool(self.destination.engine, self.destination.item_lens, None)
        status = ORIGINALS["send"](
            self.prefill,
            mooncake_session_id=self.session,
            src_data_ptrs=self.source.ptrs,
            dst_data_ptrs=reference.ptrs,
            item_lens=self.source.item_lens,
            prefill_data_indices=src_pages,
            dst_data_indices=host_pages,
            executor=None,
            dst_device_data_indices=device_pages,
            dst_device_data_ptrs={
                reference.ptrs[self.destination.ptrs.index(ptr)] for ptr in self.device_ptrs
            }
            or None,
        )
        assert status == 0
        landed = reference.tensor.numpy().copy()
        reference.close()
        return landed

    def close(self) -> None:
        receive_staging.REGIONS.release(self.decode)
        send_slots.SEND_SLOTS.release(self.prefill)
        for pool in (self.source, self.destination):
            pool.close()


class Placement:
    """Where the KV and so the send slots and the receive region are: host memory, or a GPU
    whose kernels (the gather, the scatter) and events the CUDA stand-in and the Triton
    interpreter run (tests/cuda_standin.py)."""

    def __init__(self, request, device: bool) -> None:
        self.device = device
        self.launches = {"gather": 0, "scatter": 0}
        if device:
            self.runtime = request.getfixturevalue("host_cuda")
            monkeypatch = request.getfixturevalue("monkeypatch")
            from gpu_planner.kernels import head_gather, head_scatter

            for name, module, launcher in (
                ("gather", head_gather, "launch_gather_head_slices"),
                ("scatter", head_scatter, "launch_scatter_head_slices"),
            ):
                monkeypatch.setattr(
                    module, launcher, self._counted(name, getattr(module, launcher))
                )

    def _counted(self, name, launch):
        def counted(*args, **kwargs):
            self.launches[name] += 1
            return launch(*args, **kwargs)

        return counted

    def __call__(self, pool: KVPool) -> None:
        if self.device:
            self.runtime.place(pool.tensor, 0)


@pytest.fixture(params=["host", "device"])
def placement(request) -> Placement:
    if request.param == "device" and not interpreter_enabled():
        pytest.skip("the stand-in's kernels need the Triton interpreter")
    return Placement(request, request.param == "device")


@pytest.fixture
def deployments(engines, monkeypatch):
    set_knob(monkeypatch, settings.STAGING_MIN_DESCRIPTORS.name, "8")
    set_knob(monkeypatch, settings.RECEIVE_STAGING_BYTES.name, str(4 << 20))
    set_knob(monkeypatch, settings.GATHER_STAGING_BYTES.name, str(64 << 10))  # 16 KiB slots
    settings.load()
    made: list[Deployment] = []

    def make(*args, **kwargs) -> Deployment:
        made.append(Deployment(engines, *args, **kwargs))
        return made[-1]

    yield make
    for deployment in made:
        deployment.close()
    prefill_routes.ROUTES.forget()


@pytest.mark.parametrize(
    ("item_lens", "device_buffers", "chunks"),
    [
        ([256] * 16, 0, 1),  # MHA K/V of 8 layers, one chunk
        ([256] * 16, 0, 3),  # chunked prefill: three sends of one request
        ([192] * 6 + [64] * 2, 2, 2),  # HiSparse: two device-backed buffers, their own pages
    ],
)
def test_a_staged_send_lands_what_sglangs_send_lands(
    deployments, placement, item_lens, device_buffers, chunks
):
    """In host memory, and on a GPU (the stand-in: device slots, the gather kernel and its
    event on the prefill; a device region, the scatter kernel and its event on the decode;
    HiSparse's two page spaces with every buffer on the device): the pool holds what
    sglang's own send lands, and every slot and part comes back."""
    deployment = deployments(
        item_lens, device_buffers, seed=len(item_lens) + chunks, place=placement
    )
    rng = np.random.default_rng(chunks)
    num_pages = 48
    src_pages = fragmented(rng, num_pages, np.int64)
    host_pages = fragmented(rng, num_pages)
    device_pages = fragmented(rng, num_pages) if device_buffers else None
    expected = deployment.sglang_bytes(src_pages, host_pages, device_pages)
    before = counters.snapshot()
    info = deployment.request(7, host_pages, device_pages)
    cuts = np.linspace(0, num_pages, chunks + 1).astype(int)
    for first, end in zip(cuts[:-1], cuts[1:], strict=True):
        assert deployment.send(info, src_pages, slice(first, end)) == 0
    assert len(deployment.notes) == chunks
    assert all(note[0] == STAGED_TAG for note in deployment.notes)
    pieces = sum(len(note[8]) // 16 for note in deployment.notes)  # (page_start, pages) pairs
    deployment.deliver(7)
    after = counters.snapshot()
    assert deployment.decode.request_status[7] == KV_POLL_SUCCESS
    np.testing.assert_array_equal(deployment.destination.tensor.numpy(), expected)
    staged = after["sends"].get("staged/arrays", 0) - before["sends"].get("staged/arrays", 0)
    assert staged == chunks
    assert after["descriptors"] - before["descriptors"] == pieces  # one per slot-sized piece
    assert after["staged_scatters"] - before["staged_scatters"] == pieces
    region = receive_staging.REGIONS.existing(deployment.decode)
    slots = send_slots.SEND_SLOTS.get(deployment.prefill)
    assert (region.torch_device.type, slots.torch_device.type) == (
        ("cuda", "cuda") if placement.device else ("cpu", "cpu")
    )
    if placement.device:  # each piece gathered, and each chunk scattered, by one kernel
        assert placement.launches == {"gather": pieces, "scatter": pieces}
    assert region.lent_rooms == 0 and all_slots_back(slots)
    region = receive_staging.REGIONS.existing(deployment.decode)
    assert region.lent_rooms == 0  # Success gave the part back


class PieceTimeline:
    """The staged send's gathers, engine calls and note, in the order they happen, on one of
    its two write paths.

    `parts` (host staging, the default): each piece in one part here, started on
    the wire from the sending thread and waited for when its slot is needed or the
    send ends. `executor` (as on a device, or through an engine without
    asynchronous writes): piece 0's engine call waits (10 s at most) until piece 1
    was gathered, so a send that gathers only after each call fails the test
    rather than hangs. `failing_write` makes that piece's write end with -1.
    """

    def __init__(
        self, monkeypatch, deployment: Deployment, path: str, failing_write: int | None = None
    ):
        self.events: list[str] = []
        self.lowest_free_slots = send_slots.SLOTS
        self._lock = threading.Lock()
        self._gathered = [threading.Event() for _ in range(16)]
        self._failing_write = failing_write
        self._writes = iter(range(16))
        self._gathers = iter(range(16))
        self._pieces: dict[int, int] = {}  # a parts write's batch -> its piece
        self._staging = send_slots.SEND_SLOTS.get(deployment.prefill)
        if path == "executor":
            monkeypatch.setattr(staged_send, "part_writes", lambda *_: None)
            gather, write = staged_send.gather_into_slot, send_slots.write_chunk
            monkeypatch.setattr(staged_send, "gather_into_slot", self._spy(gather, self._gather))
            monkeypatch.setattr(send_slots, "write_chunk", self._spy(write, self._write))
        else:
            monkeypatch.setattr(staged_send, "PART_BYTES", 1 << 40)  # one part per piece
            parts = staged_send.gather_in_parts
            monkeypatch.setattr(staged_send, "gather_in_parts", self._spy(parts, self._parts))
            submit, wait = adapter.AsyncWrites.submit, adapter.AsyncWrites.wait
            monkeypatch.setattr(adapter.AsyncWrites, "submit", self._spy(submit, self._submit))
            monkeypatch.setattr(adapter.AsyncWrites, "wait", self._spy(wait, self._wait))
        keep_note = deployment.prefill._send_multipart_locked
        deployment.prefill._send_multipart_locked = self._spy(keep_note, self._note)

    def _spy(self, original, around):
        return lambda *args, **kwargs: around(original, *args, **kwargs)

    def add(self, event: str) -> None:
        with self._lock:
            self.events.append(event)
            self.lowest_free_slots = min(self.lowest_free_slots, self._staging.free_slots)

    def _gather(self, original, *args):
        number = next(self._gathers)
        self.add(f"gather {number}")
        ready = original(*args)
        self.add(f"gather {number} ended")
        self._gathered[number].set()
        return ready

    def _parts(self, original, *args):
        number = next(self._gathers)
        parts = original(*args)  # checked, nothing gathered yet

        def gathering():
            self.add(f"gather {number}")
            yield from parts
            self.add(f"gather {number} ended")

        return gathering()

    def _write(self, original, *args):
        number = next(self._writes)
        if number == 0:
            assert self._gathered[1].wait(60), "piece 1 was not gathered while piece 0 waited"
        status = -1 if number == self._failing_write else original(*args)
        self.add(f"write {number} ended")
        return status

    def _submit(self, original, *args):
        batch = original(*args)
        self._pieces[batch] = next(self._writes)
        return batch

    def _wait(self, original, writes, batch):
        number = self._pieces[batch]
        status = original(writes, batch)
        self.add(f"write {number} ended")
        return -1 if number == self._failing_write else status

    def _note(self, original, *args, **kwargs):
        self.add("note")
        return original(*args, **kwargs)

    def before(self, first: str, then: str) -> bool:
        return self.events.index(first) < self.events.index(then)


WRITE_PATHS = ("parts", "executor")


@pytest.mark.parametrize("path", WRITE_PATHS)
def test_the_next_piece_is_gathered_while_one_is_on_the_wire(deployments, monkeypatch, path):
    """Three pieces through two slots: piece 1 is gathered during piece 0's engine call, piece 2
    only into a slot whose call ended, and the note follows the last call; bytes are sglang's."""
    deployment = deployments([256] * 8, 0, seed=21)  # 2 KiB pages: 8 per 16 KiB slot
    rng = np.random.default_rng(22)
    src_pages, host_pages = fragmented(rng, 24, np.int64), fragmented(rng, 24)
    expected = deployment.sglang_bytes(src_pages, host_pages, None)
    timeline = PieceTimeline(monkeypatch, deployment, path)
    info = deployment.request(5, host_pages, None)
    assert deployment.send(info, src_pages, slice(0, 24)) == 0
    assert timeline.before("gather 1 ended", "write 0 ended")  # overlap
    assert timeline.before("write 0 ended", "gather 2")  # a slot is reused after its call
    assert timeline.events[-1] == "note" and timeline.before("write 2 ended", "note")
    assert timeline.lowest_free_slots == send_slots.SLOTS - 2  # a send holds two slots at most
    assert all_slots_back(timeline._staging)
    deployment.deliver(5)
    assert deployment.decode.request_status[5] == KV_POLL_SUCCESS
    np.testing.assert_array_equal(deployment.destination.tensor.numpy(), expected)


@pytest.mark.parametrize(  # device slots write each piece from the executor (no parts)
    ("placement", "path"),
    [("host", "parts"), ("host", "executor"), ("device", "executor")],
    indirect=["placement"],
)
def test_a_failed_piece_fails_the_send_without_a_note(deployments, placement, monkeypatch, path):
    """Piece 1's call fails: the send returns sglang's -1, no piece is gathered after the
    failure was seen, the decode gets no note (it scatters nothing), every other slot comes back
    and the failed piece's slot is held (the engine may still read it). Device slots write
    each piece from the executor once its gather's event completed."""
    deployment = deployments([256] * 8, 0, seed=23, place=placement)
    rng = np.random.default_rng(24)
    src_pages, host_pages = fragmented(rng, 40, np.int64), fragmented(rng, 40)  # five pieces
    timeline = PieceTimeline(monkeypatch, deployment, path, failing_write=1)
    info = deployment.request(6, host_pages, None)
    assert deployment.send(info, src_pages, slice(0, 40)) == -1
    assert all_slots_back(timeline._staging, held=1)
    assert "note" not in timeline.events and not deployment.notes
    failed_at = timeline.events.index("write 1 ended")
    # The spy logs the failed call before its future is done: one gather may start in between.
    gathers_after = [e for e in timeline.events[failed_at + 1 :] if e.startswith("gather")]
    assert len([e for e in gathers_after if "ended" not in e]) <= 1, timeline.events
    assert sum(event.startswith("gather") and "ended" not in event for event in timeline.events) < 5
    deployment.deliver(6, KV_POLL_FAILED)
    assert deployment.decode.request_status[6] == KV_POLL_FAILED
    assert not deployment.destination.tensor.numpy().any()  # nothing scattered


def test_a_host_piece_goes_in_parts_each_on_the_wire_before_the_next_is_gathered(
    deployments, monkeypatch
):
    """One piece (a 16 KiB slot: 4 pages of 16 buffers) in four parts: each part's write starts
    right after its gather and before the next part's, the writes tile the piece, and the
    decode gets sglang's bytes."""
    deployment = deployments([256] * 16, 0, seed=25)
    rng = np.random.default_rng(26)
    src_pages, host_pages = fragmented(rng, 4, np.int64), fragmented(rng, 4)
    expected = deployment.sglang_bytes(src_pages, host_pages, None)
    piece_bytes = 4 * 16 * 256
    monkeypatch.setattr(staged_send, "PART_BYTES", piece_bytes // 4)
    events, writes = [], []
    gather_loop = staged_send.gather_in_parts.__globals__["gather_loop"]

    def logged_loop(entries, *args):
        events.append(f"gather {len(entries)} buffers")
        return gather_loop(entries, *args)

    def logged_submit(writes_, session, src, dst, nbytes):
        events.append("write")
        writes.append((src, dst, nbytes))
        return submit(writes_, session, src, dst, nbytes)

    submit = adapter.AsyncWrites.submit
    monkeypatch.setitem(staged_send.gather_in_parts.__globals__, "gather_loop", logged_loop)
    monkeypatch.setattr(adapter.AsyncWrites, "submit", logged_submit)
    info = deployment.request(8, host_pages, None)
    assert deployment.send(info, src_pages, slice(0, 4)) == 0
    assert events == ["gather 4 buffers", "write"] * 4
    srcs, dsts, lens = (np.array(column) for column in zip(*writes, strict=True))
    assert (lens == piece_bytes // 4).all()
    assert (np.diff(srcs) == lens[:-1]).all() and (np.diff(dsts) == lens[:-1]).all()
    deployment.deliver(8)
    assert deployment.decode.request_status[8] == KV_POLL_SUCCESS
    np.testing.assert_array_equal(deployment.destination.tensor.numpy(), expected)


def test_a_refused_note_fails_the_request_instead_of_landing_partial_kv(deployments):
    deployment = deployments([256] * 16, 0, seed=3)
    rng = np.random.default_rng(5)
    src_pages, host_pages = fragmented(rng, 32, np.int64), fragmented(rng, 32)
    info = deployment.request(9, host_pages, None)
    assert deployment.send(info, src_pages, slice(0, 32)) == 0
    note = deployment.notes[0]
    note[8] = np.array([[0, 33]], dtype="<u8").tobytes()  # pages past the request's 32
    deployment.deliver(9)
    assert deployment.decode.request_status[9] == KV_POLL_FAILED
    assert "gpu_planner" in deployment.decode.failure_records[9]
    assert not deployment.destination.tensor.numpy().any()  # nothing scattered
    region = receive_staging.REGIONS.existing(deployment.decode)
    assert region.lent_rooms == 1  # quarantined: a prefill may still write there


@pytest.mark.parametrize(
    ("item_lens", "device_buffers"), [([256] * 8, 0), ([192] * 6 + [64] * 2, 2)]
)  # MHA; HiSparse: two device-backed buffers by their own pages
def test_a_plain_decode_gets_todays_descriptors(engines, monkeypatch, item_lens, device_buffers):
    """No capability advertised (staging off on the decode): the send is planned as before."""
    set_knob(monkeypatch, settings.RECEIVE_STAGING_BYTES.name, "0")
    set_knob(monkeypatch, settings.STAGING_MIN_DESCRIPTORS.name, "1")
    settings.load()
    deployment = Deployment(engines, item_lens, device_buffers, seed=4)
    try:
        rng = np.random.default_rng(6)
        src_pages, host_pages = fragmented(rng, 32, np.int64), fragmented(rng, 32)
        device_pages = fragmented(rng, 32) if device_buffers else None
        expected = deployment.sglang_bytes(src_pages, host_pages, device_pages)
        info = deployment.request(11, host_pages, device_pages)
        before = counters.snapshot()
        assert deployment.send(info, src_pages, slice(0, 32)) == 0
        assert not deployment.notes
        assert counters.snapshot()["sends"].get("staged/arrays", 0) == before["sends"].get(
            "staged/arrays", 0
        )
        np.testing.assert_array_equal(deployment.destination.tensor.numpy(), expected)
    finally:
        deployment.close()
        prefill_routes.ROUTES.forget()


@pytest.mark.parametrize(
    ("knob", "value", "reason"),
    [
        (settings.STAGING_MIN_DESCRIPTORS, "1000", "fewer than {} descriptors"),
        (settings.STAGING_MAX_MEAN_BYTES, "511", "mean descriptor above {}"),
    ],
)
def test_a_send_below_the_gate_goes_as_planned_counted(
    deployments, monkeypatch, knob, value, reason
):
    """Toward a decode that lent the request a part: fewer descriptors (32 pages in runs of
    about 2 of 8 buffers: at most 256), or larger ones on average (512 B), than the gate
    sends today's descriptors, counted as the gate's choice (not as a fallback)."""
    set_knob(monkeypatch, knob.name, value)
    settings.load()
    deployment = deployments([256] * 8, 0, seed=5)
    rng = np.random.default_rng(7)
    src_pages, host_pages = fragmented(rng, 32, np.int64), fragmented(rng, 32)
    expected = deployment.sglang_bytes(src_pages, host_pages, None)
    info = deployment.request(12, host_pages, None)
    before = counters.snapshot()
    assert deployment.send(info, src_pages, slice(0, 32)) == 0
    after = counters.snapshot()
    assert not deployment.notes
    assert after["sends"].get("generic/arrays", 0) - before["sends"].get("generic/arrays", 0) == 1
    choice = f"direct/below the gate: {reason.format(knob.name)}"  # the gate's choice, counted
    assert after["paths_chosen"].get(choice, 0) - before["paths_chosen"].get(choice, 0) == 1
    assert after["fallbacks"] == before["fallbacks"]  # a choice, not a fallback
    np.testing.assert_array_equal(deployment.destination.tensor.numpy(), expected)
    deployment.deliver(12)
    assert receive_staging.REGIONS.existing(deployment.decode).lent_rooms == 0


def test_a_staged_choice_whose_request_does_not_line_up_goes_direct_counted(deployments):
    """The gate stages the send, but its pages are a copy of the request's (no lent part is
    found for them): it goes as planned and lands sglang's bytes, counted direct under the
    line-up's reason, while a send of the request's own pages is counted staged."""
    deployment = deployments([256] * 8, 0, seed=9)
    rng = np.random.default_rng(10)
    src_pages, host_pages = fragmented(rng, 32, np.int64), fragmented(rng, 32)
    expected = deployment.sglang_bytes(src_pages, host_pages, None)
    info = deployment.request(14, host_pages, None)
    reason = "no part of the decode's receive staging lent to this request"
    before = counters.snapshot()
    copied = dataclasses.replace(info, dst_kv_indices=info.dst_kv_indices.copy())
    assert deployment.send(copied, src_pages, slice(0, 32)) == 0
    after = counters.snapshot()

    def grew(table: str, key: str) -> int:
        return after[table].get(key, 0) - before[table].get(key, 0)

    assert not deployment.notes and grew("sends", "generic/arrays") == 1
    assert grew("paths_chosen", f"direct/{reason}") == 1
    assert after["fallbacks"] == before["fallbacks"]  # the hook's own send: not a fallback
    assert grew("paths_chosen", f"staged/{path_cost.PASSES_GATE}") == 0
    np.testing.assert_array_equal(deployment.destination.tensor.numpy(), expected)
    assert deployment.send(info, src_pages, slice(0, 32)) == 0
    after = counters.snapshot()
    assert len(deployment.notes) == 1
    assert grew("paths_chosen", f"staged/{path_cost.PASSES_GATE}") == 1
    deployment.deliver(14)


class RecordedCosts(path_cost.PathCosts):
    """The process's model, keeping what the send path told it: the paths taken, the sends
    observed (public calls only)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.taken_paths: list[str] = []
        self.observed_paths: list[str] = []

    def taken(self, peer, choice, path) -> None:
        self.taken_paths.append(path)
        super().taken(peer, choice, path)

    def observe(self, peer, path, requests, nbytes, seconds, ok=True) -> bool:
        self.observed_paths.append(path)
        return super().observe(peer, path, requests, nbytes, seconds, ok)


def count_changes(before: dict, after: dict, table: str) -> dict[str, int]:
    return {
        key: count - before[table].get(key, 0)
        for key, count in after[table].items()
        if count != before[table].get(key, 0)
    }


def test_a_staged_choice_that_finds_every_slot_lent_is_counted_once_as_direct(deployments):
    """The gate prices the send staged and the request lines up, but every send slot is lent
    to other sends: it goes direct, counted once under that path with that reason, the model
    told it went direct (no staged choice), and sglang's bytes land."""
    deployment = deployments([256] * 8, 0, seed=15)
    rng = np.random.default_rng(16)
    src_pages, host_pages = fragmented(rng, 32, np.int64), fragmented(rng, 32)
    expected = deployment.sglang_bytes(src_pages, host_pages, None)
    info = deployment.request(15, host_pages, None)
    slots = send_slots.SEND_SLOTS.get(deployment.prefill)
    lent = [slots.try_take() for _ in range(send_slots.SLOTS)]
    costs = RecordedCosts.from_settings()
    before = counters.snapshot()
    try:
        with path_cost.deciding(costs):
            assert deployment.send(info, src_pages, slice(0, 32)) == 0
    finally:
        for slot in lent:
            slots.give_back(slot)
    after = counters.snapshot()
    assert count_changes(before, after, "paths_chosen") == {
        f"{send_path.DIRECT}/{send_path.SLOTS_BUSY}": 1
    }
    assert count_changes(before, after, "sends") == {"generic/arrays": 1}
    assert after["fallbacks"] == before["fallbacks"]
    assert costs.taken_paths == [send_path.DIRECT]
    assert costs.observed_paths == [send_path.DIRECT]
    assert not deployment.notes
    deployment.deliver(15)
    assert deployment.decode.request_status[15] == KV_POLL_SUCCESS
    np.testing.assert_array_equal(deployment.destination.tensor.numpy(), expected)


def test_two_threads_with_one_slot_count_each_send_under_the_path_it_took(deployments, monkeypatch):
    """Two sends to one peer, one free slot: the first holds it while it gathers, the second
    decides meanwhile and goes direct. `paths_chosen` by path equals the sends each hook
    counted, the model is told each path once and observes what ran, and both requests
    land sglang's bytes."""
    deployment = deployments([256] * 8, 0, seed=17)
    rng = np.random.default_rng(18)
    src_pages = fragmented(rng, 32, np.int64)
    both = fragmented(rng, 64)
    host_pages = [both[:32], both[32:]]  # two requests' own pages
    slots = send_slots.SEND_SLOTS.get(deployment.prefill)
    lent = [slots.try_take() for _ in range(send_slots.SLOTS - 1)]
    gathering, second_decided = threading.Event(), threading.Event()
    gather_in_parts = staged_send.gather_in_parts

    def held_gather(*args, **kwargs):
        gathering.set()
        assert second_decided.wait(30)
        yield from gather_in_parts(*args, **kwargs)

    monkeypatch.setattr(staged_send, "gather_in_parts", held_gather)
    costs = RecordedCosts.from_settings()
    infos = [deployment.request(room, host_pages[room - 20], None) for room in (20, 21)]
    before = counters.snapshot()
    try:
        with path_cost.deciding(costs), concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(deployment.send, infos[0], src_pages, slice(0, 32))
            assert gathering.wait(30)
            second = pool.submit(deployment.send, infos[1], src_pages, slice(0, 32))
            assert second.result(timeout=30) == 0
            second_decided.set()
            assert first.result(timeout=30) == 0
    finally:
        second_decided.set()
        for slot in lent:
            slots.give_back(slot)
    after = counters.snapshot()
    chosen = count_changes(before, after, "paths_chosen")
    sends = count_changes(before, after, "sends")
    assert chosen == {
        f"{send_path.STAGED}/{path_cost.PASSES_GATE}": 1,
        f"{send_path.DIRECT}/{send_path.SLOTS_BUSY}": 1,
    }
    assert sends == {"staged/arrays": 1, "generic/arrays": 1}
    assert sorted(costs.taken_paths) == sorted(costs.observed_paths) == ["direct", "staged"]
    assert after["fallbacks"] == before["fallbacks"]
    assert len(deployment.notes) == 1
    for room in (20, 21):
        deployment.deliver(room)
        assert deployment.decode.request_status[room] == KV_POLL_SUCCESS
    reference = kv_pool(deployment.destination.engine, deployment.destination.item_lens, None)
    try:
        for pages in host_pages:
            status = ORIGINALS["send"](
                deployment.prefill, mooncake_session_id=deployment.session,
                src_data_ptrs=deployment.source.ptrs, dst_data_ptrs=reference.ptrs,
                item_lens=deployment.source.item_lens, prefill_data_indices=src_pages,
                dst_data_indices=pages, executor=None, dst_device_data_indices=None,
                dst_device_data_ptrs=None,
            )  # fmt: skip
            assert status == 0
        np.testing.assert_array_equal(
            deployment.destination.tensor.numpy(), reference.tensor.numpy()
        )
    finally:
        reference.close()


SLICE_SEND = inspect.unwrap(conn.MooncakeKVManager.send_kvcache_slice)  # sglang's own


def decode_request(decode, room: int, host_pages: np.ndarray, ranks: int) -> list[bytes]:
    """The decode's metadata for a new request of `room` answered by `ranks` prefill ranks."""
    decode.request_status[room] = KV_POLL_TRANSFERRING
    decode.prefill_response_tracker[room] = set()
    decode.required_prefill_response_num_table[room] = ranks
    metadata = TransferRequest(
        room=room, endpoint="127.0.0.1", port=17000, session_id=decode.engine.session_id,
        host_pages=host_pages,
    ).to_frames()  # fmt: skip
    return receive_staging.metadata_message_hook(
        lambda _, **kwargs: metadata, decode, bootstrap_room=room, required_dst_info_num=1,
        kv_indices=host_pages, aux_index=0, state_indices=None, decode_prefix_len=0,
        is_dummy=False,
    )  # fmt: skip


def advertised_registration(decode, pool: KVPool) -> list[bytes]:
    """The decode's KV registration with its receive staging, as a prefill receives it."""
    registration = registration_frames(pool, decode.engine.session_id)
    return receive_staging.registration_message_hook(lambda _: registration, decode)


@pytest.mark.parametrize(
    ("prefill_tp", "order"), [(2, (0, 1)), (2, (1, 0)), (4, (3, 0, 2, 1))]
)  # TP 4: two replicas of each KV head, both writing its share, as sglang's own send does
def test_tp_down_ranks_and_head_replicas_land_sglangs_bytes(
    engines, monkeypatch, placement, prefill_tp, order
):
    """Prefill attention TP 2 or 4 -> decode TP 1, 2 KV heads: each prefill rank sends half of
    every decode token slot through the hooked `send_kvcache_slice`, staged, and its status
    through sglang's status frames; the decode's pool equals what sglang's own send lands."""
    set_knob(monkeypatch, settings.RECEIVE_STAGING_BYTES.name, str(4 << 20))
    set_knob(monkeypatch, settings.GATHER_STAGING_BYTES.name, str(64 << 10))
    settings.load()
    prefill_engine, decode_engine = engines
    session, heads, head_bytes, num_pages, room = decode_engine.session_id, 2, 32, 40, 3
    decode_lens = [PAGE_SIZE * heads * head_bytes] * 8  # K/V of 4 layers
    destination = kv_pool(decode_engine, decode_lens, None)
    placement(destination)
    reference = kv_pool(decode_engine, decode_lens, None)
    decode = decode_manager(decode_engine, destination)
    notes: list[list[bytes]] = []
    sources = []
    try:
        advertised = advertised_registration(decode, destination)
        rng = np.random.default_rng(8)
        host_pages = fragmented(rng, num_pages)
        metadata = decode_request(decode, room, host_pages, prefill_tp)
        before = counters.snapshot()["sends"].get("staged/arrays", 0)
        for rank in order:
            head = rank * heads // prefill_tp  # replicas of one head hold the same KV
            source = kv_pool(prefill_engine, [PAGE_SIZE * head_bytes] * 8, seed=20 + head)
            placement(source)
            sources.append(source)
            prefill = make_manager(
                prefill_engine, kv_data_ptrs=source.ptrs, kv_data_lens=source.lens,
                attn_tp_rank=rank,
            )  # fmt: skip
            prefill.kv_args.kv_item_lens, prefill.kv_args.page_size = source.item_lens, PAGE_SIZE
            prefill.kv_args.engine_rank, prefill.kv_args.kv_layer_ids = rank, []
            prefill.kv_args.kv_head_num, prefill.kv_args.total_kv_head_num = 1, heads
            prefill.attn_tp_size = prefill_tp
            prefill._send_multipart_locked = lambda _, parts, is_ipv6=False: notes.append(parts)
            prefill.decode_kv_args_table = {session: conn.KVArgsRegisterInfo.from_zmq(advertised)}
            info = conn.TransferInfo.from_zmq(metadata)
            prefill.transfer_infos[room] = {session: info}
            src_pages = fragmented(np.random.default_rng(30 + head), num_pages, np.int64)
            arguments = (session, src_pages)
            tail = (0, 1, decode_lens[0], SEND_EXECUTOR, None)
            hooked = conn.MooncakeKVManager.send_kvcache_slice
            assert hooked(prefill, *arguments, destination.ptrs, info.dst_kv_indices, *tail) == 0
            assert SLICE_SEND(prefill, *arguments, reference.ptrs, host_pages, *tail) == 0
            for note in notes:
                assert conn.MooncakeKVManager.handle_chunk_ready(decode, note) is True
            notes.clear()
            deliver_status(prefill, decode, room, KV_POLL_SUCCESS)
            send_slots.SEND_SLOTS.release(prefill)
        assert decode.request_status[room] == KV_POLL_SUCCESS
        assert counters.snapshot()["sends"].get("staged/arrays", 0) - before == prefill_tp
        np.testing.assert_array_equal(destination.tensor.numpy(), reference.tensor.numpy())
        if placement.device:  # each rank's pieces gathered and scattered by the kernels
            assert placement.launches["gather"] >= prefill_tp
            assert placement.launches["scatter"] == placement.launches["gather"]
        assert receive_staging.REGIONS.existing(decode).lent_rooms == 0
    finally:
        receive_staging.REGIONS.release(decode)
        for pool in (*sources, destination, reference):
            pool.close()
        prefill_routes.ROUTES.forget()


def test_pipeline_stages_send_direct_and_land_sglangs_bytes(deployments):
    """Prefill PP 2 -> decode PP 1: each stage holds half the layers, so neither is staged (the
    staged layout places every decode buffer's pages); both go as planned, counted, declare
    no note, and the request succeeds with the bytes sglang's own sends land."""
    deployment = deployments([256] * 16, 0, seed=40)  # the decode: K/V of 8 layers
    prefill_engine = deployment.prefill.engine
    rng = np.random.default_rng(41)
    num_pages, room = 32, 13
    src_pages, host_pages = fragmented(rng, num_pages, np.int64), fragmented(rng, num_pages)
    info = deployment.request(room, host_pages, None)
    deployment.decode.required_prefill_response_num_table[room] = 2
    reference = kv_pool(deployment.destination.engine, [256] * 16, None)
    key = f"direct/{staged_send.PIPELINE_STAGE}"
    before = counters.snapshot()
    stages = []
    try:
        for stage in range(2):
            layers = [*range(4 * stage, 4 * stage + 4), *range(8 + 4 * stage, 12 + 4 * stage)]
            ptrs = [deployment.source.ptrs[layer] for layer in layers]
            lens = [deployment.source.lens[layer] for layer in layers]
            prefill = make_manager(
                prefill_engine, pp_size=2, start_layer=4 * stage, end_layer=4 * stage + 4,
                kv_data_ptrs=ptrs, kv_data_lens=lens, pp_rank=stage,
            )  # fmt: skip
            prefill.decode_kv_args_table = deployment.prefill.decode_kv_args_table
            prefill.transfer_infos[room] = {deployment.session: info}
            stages.append(prefill)
            call = dict(
                mooncake_session_id=deployment.session, src_data_ptrs=ptrs,
                item_lens=[256] * 8, prefill_data_indices=src_pages,
                executor=SEND_EXECUTOR, dst_device_data_indices=None, dst_device_data_ptrs=None,
            )  # fmt: skip
            hooked = hooked_send()(
                prefill, dst_data_ptrs=deployment.destination.ptrs,
                dst_data_indices=info.dst_kv_indices, **call,
            )  # fmt: skip
            assert hooked == 0
            own = ORIGINALS["send"](
                prefill, dst_data_ptrs=reference.ptrs, dst_data_indices=host_pages, **call
            )
            assert own == 0
            deliver_status(prefill, deployment.decode, room, KV_POLL_SUCCESS)
        after = counters.snapshot()
        assert after["paths_chosen"].get(key, 0) - before["paths_chosen"].get(key, 0) == 2
        assert after["fallbacks"] == before["fallbacks"]
        assert after["sends"].get("staged/arrays", 0) == before["sends"].get("staged/arrays", 0)
        assert deployment.decode.request_status[room] == KV_POLL_SUCCESS
        np.testing.assert_array_equal(
            deployment.destination.tensor.numpy(), reference.tensor.numpy()
        )
        assert deployment.destination.tensor.numpy().any()
    finally:
        reference.close()
        for prefill in stages:
            send_slots.SEND_SLOTS.release(prefill)


@pytest.mark.parametrize("ending", ["abort", "waiting timeout", "clear"])
def test_a_reused_room_lands_its_own_bytes_and_never_the_previous_requests(deployments, ending):
    """sglang ends request 1 of a room by one of its paths that never reach a status (its
    receiver's abort or waiting timeout, then its clear; or clear alone), then opens request
    2 of the same room with as many pages: request 2 gets a part of its own, request 1's late
    notes scatter nothing (its freed pages stay as they were), and request 2 ends Success
    with exactly the bytes sglang's own send lands in its pages."""
    deployment = deployments([256] * 8, 0, seed=50)
    decode, room, num_pages = deployment.decode, 21, 16
    rng = np.random.default_rng(51)
    pages = fragmented(rng, 2 * num_pages)
    first_pages, second_pages = pages[:num_pages], pages[num_pages:]
    first_src, second_src = (fragmented(rng, num_pages, np.int64) for _ in range(2))
    expected = deployment.sglang_bytes(second_src, second_pages, None)
    region = receive_staging.REGIONS.existing(decode)

    first = conn.MooncakeKVReceiver(decode, "127.0.0.1:8998", room)
    first.init_time = 0.0  # its metadata went out long ago: past sglang's waiting timeout
    first_info = deployment.request(room, first_pages, None)
    first_route, _ = prefill_routes.ROUTES.route_for(first_info.dst_kv_indices[:])
    assert deployment.send(first_info, first_src, slice(0, num_pages)) == 0
    stale_notes, deployment.notes = deployment.notes, []
    if ending == "abort":
        first.abort()
    elif ending == "waiting timeout":
        assert first._check_waiting_timeout() == KV_POLL_FAILED
    first.clear()
    assert room not in decode.request_status and region.lent_rooms == 1  # quarantined

    second = conn.MooncakeKVReceiver(decode, "127.0.0.1:8998", room)
    second_info = deployment.request(room, second_pages, None)
    second_route, _ = prefill_routes.ROUTES.route_for(second_info.dst_kv_indices[:])
    assert second_route.reservation.reservation_id != first_route.reservation.reservation_id
    assert second_route.reservation.offset != first_route.reservation.offset
    dropped = counters.snapshot()["receive_staging_fallbacks"].get(
        "staged note for no live lending", 0
    )
    for note in stale_notes:  # request 1's prefill, late
        assert conn.MooncakeKVManager.handle_chunk_ready(decode, note) is True
    assert counters.snapshot()["receive_staging_fallbacks"].get(
        "staged note for no live lending", 0
    ) == dropped + len(stale_notes)
    assert not deployment.destination.tensor.numpy().any()  # nothing scattered anywhere
    assert deployment.send(second_info, second_src, slice(0, num_pages)) == 0
    deployment.deliver(room)
    assert decode.request_status[room] == KV_POLL_SUCCESS
    np.testing.assert_array_equal(deployment.destination.tensor.numpy(), expected)
    second.clear()


def damaged(note: list[bytes], damage: str) -> list[bytes]:
    """A real note, damaged in transit."""
    note = list(note)
    if damage == "cut":
        return note[:5]
    if damage == "wrong tag":
        return [b"gpu_planner.staget/2", *note[1:]]
    if damage == "old version":
        return [b"gpu_planner.staged/1", *note[1:]]
    if damage == "device flags flipped":
        note[7] = bytes(1 - flag for flag in note[7])
        return note
    raise AssertionError(damage)


@pytest.mark.parametrize("damage", ["cut", "wrong tag", "old version", "device flags flipped"])
def test_a_damaged_note_of_a_real_send_fails_its_request(deployments, damage):
    """Whether the note no longer parses, is no note of ours (sglang drops it), or claims the
    other HiSparse space for a buffer: the request fails, and no byte of the damaged chunk
    is scattered."""
    deployment = deployments([192] * 6 + [64] * 2, 2, seed=60)
    rng = np.random.default_rng(61)
    src_pages, host_pages = fragmented(rng, 32, np.int64), fragmented(rng, 32)
    device_pages = fragmented(rng, 32)
    info = deployment.request(17, host_pages, device_pages)
    assert deployment.send(info, src_pages, slice(0, 32)) == 0
    [note] = deployment.notes
    deployment.notes = [damaged(note, damage)]
    deployment.deliver(17)
    assert deployment.decode.request_status[17] == KV_POLL_FAILED
    assert deployment.decode.failure_records[17].startswith("gpu_planner:")
    assert not deployment.destination.tensor.numpy().any()


def test_two_thousand_sends_some_to_a_dead_region_leak_no_slot_part_or_memory(
    deployments, monkeypatch
):
    """Every tenth write goes where the decode no longer has memory (as when it died mid-send):
    that send fails as sglang's do (-1, its room then Failed), the next ones succeed, and the
    prefill's slots, the decode's parts and this process's memory stay flat."""
    import tracemalloc

    # No hold after a failed write: each dead send's slot and part are back at once.
    monkeypatch.setattr(receive_staging, "stalled_write_s", lambda: 0.0)
    monkeypatch.setattr(send_slots, "stalled_write_s", lambda: 0.0)
    deployment = deployments([256] * 8, 0, seed=12)
    prefill_routes.ROUTES.advertised(
        DEAD_SESSION, prefill_routes.ROUTES.capability(deployment.session)
    )
    registration = deployment.prefill.decode_kv_args_table[deployment.session]
    deployment.prefill.decode_kv_args_table[DEAD_SESSION] = registration
    rng = np.random.default_rng(13)
    src_pages, host_pages = fragmented(rng, 16, np.int64), fragmented(rng, 16)
    region = receive_staging.REGIONS.existing(deployment.decode)
    staging = send_slots.SEND_SLOTS.get(deployment.prefill)
    tracemalloc.start()
    try:
        for room in range(2000):
            if room == 500:
                settled = tracemalloc.get_traced_memory()[0]
            info = deployment.request(room, host_pages, None)
            dead = room % 10 == 9
            if dead:  # the decode is gone: its session refuses connections
                route, _ = prefill_routes.ROUTES.route_for(info.dst_kv_indices[:])
                prefill_routes.ROUTES.lend(
                    info.dst_kv_indices, dataclasses.replace(route, session=DEAD_SESSION)
                )
            status = deployment.send(
                info, src_pages, slice(0, 16), session=DEAD_SESSION if dead else None
            )
            assert status == (-1 if dead else 0), room
            deployment.deliver(room, KV_POLL_FAILED if dead else KV_POLL_SUCCESS)
            deployment.decode.request_status.pop(room)  # sglang clears the room, both sides
            deployment.prefill.transfer_infos.pop(room)
            assert all_slots_back(staging), room
        grown = tracemalloc.get_traced_memory()[0] - settled
    finally:
        tracemalloc.stop()
    region.reserve(deployment.decode.request_status, 10**6, host_pages[:0], None)  # a sweep
    assert region.lent_rooms == 0
    assert region.free_bytes == region.region.numel()
    assert grown < 1 << 20, f"{grown} bytes more after 1,500 sends"

"""Receive staging's decode side and the prefill's parser hooks, unit by unit.

The decode side is a real `MooncakeKVManager` (built with `object.__new__`,
holding what the staging and the status handling read) over a host KV pool,
with a fake engine wrapper that records `register`/`deregister`. The hooks
are called as sglang's HookRegistry calls them: `(original, manager, ...)`,
with an `original` that stands for sglang's own function. Staged bytes are
written into the region by the test, as a prefill's RDMA would, and the KV
pool is compared with a plain-Python reference of the layout the wire
format's docstring describes.
"""

from __future__ import annotations

import gc
import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from sglang_plugin_support import conn, make_decode_manager, registration_frames
from suite_support import set_knob

from gpu_planner import settings
from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.integration.sglang import counters, page_sizes, prefill_routes, receive_staging
from gpu_planner.integration.sglang.frames import TransferRequest
from gpu_planner.integration.sglang.staging_wire import (
    DECLARED_TAG,
    STAGED_TAG,
    Capability,
    Reservation,
    Staged,
    declared_frames,
    declared_notes,
)

PAGE_SIZE = 4
POOL_PAGES = 32
ITEM_LENS = [64, 64, 32, 32]  # 16 and 8 bytes per token: two writers share 8 and 4 bytes
PAGE_BYTES = sum(ITEM_LENS)
REGION_BYTES = 64 << 10
ALIGNMENT = receive_staging.ALIGNMENT
KV_POLL_TRANSFERRING, KV_POLL_SUCCESS, KV_POLL_FAILED = 3, 4, 0
SESSION = "127.0.0.1:16001"
DECODE_SESSION = "127.0.0.1:16002"  # the decode's own Mooncake session, as declarations name it


class FakeEngine:
    """sglang's engine wrapper as the staging uses it: records every call."""

    def __init__(self, fail_register: Exception | None = None) -> None:
        self.calls: list[tuple] = []
        self.fail_register = fail_register

    def get_session_id(self) -> str:
        return DECODE_SESSION

    def register(self, ptr: int, length: int) -> None:
        self.calls.append(("register", ptr, length))
        if self.fail_register is not None:
            raise self.fail_register

    def deregister(self, ptr: int) -> None:
        self.calls.append(("deregister", ptr))


class Pool:
    """KV buffers of POOL_PAGES pages each, in one host tensor of random bytes."""

    def __init__(self, item_lens: list[int], seed: int) -> None:
        self.item_lens = list(item_lens)
        self.offsets = np.cumsum([0] + [POOL_PAGES * n for n in item_lens]).tolist()
        data = np.random.default_rng(seed).integers(0, 256, self.offsets[-1], dtype=np.uint8)
        self.tensor = torch.from_numpy(data)

    @property
    def ptrs(self) -> list[int]:
        return [self.tensor.data_ptr() + offset for offset in self.offsets[:-1]]

    @property
    def lens(self) -> list[int]:
        return [POOL_PAGES * n for n in self.item_lens]

    def bytes(self) -> np.ndarray:
        return self.tensor.numpy().copy()

    def page(self, buffer: int, page: int) -> slice:
        start = self.offsets[buffer] + page * self.item_lens[buffer]
        return slice(start, start + self.item_lens[buffer])


def decode_manager(
    engine, pool: Pool, mode: str = "DECODE", device_buffers: int = 0
) -> conn.MooncakeKVManager:
    """A real decode-side manager over `pool` (`bench.sglang_manager.make_decode_manager`);
    its last `device_buffers` buffers take HiSparse's device pages."""
    return make_decode_manager(
        engine, pool.ptrs, pool.lens, pool.item_lens, PAGE_SIZE, mode, device_buffers
    )


class Decode:
    """One decode manager and the hooked calls sglang makes on it."""

    def __init__(self, item_lens=ITEM_LENS, engine=None, seed=0, mode="DECODE", device_buffers=0):
        self.engine = FakeEngine() if engine is None else engine
        self.pool = Pool(item_lens, seed)
        self.manager = decode_manager(self.engine, self.pool, mode, device_buffers)
        self.sent: dict[tuple[int, int], dict[int, int]] = {}  # (room, rank): {reservation: notes}

    @property
    def region(self) -> receive_staging.ReceiveRegion | None:
        return receive_staging.REGIONS.existing(self.manager)

    def advertise(self) -> tuple[list[bytes], list[bytes]]:
        """(sglang's registration frames, what the hooked builder returns)."""
        frames = registration_frames(self.pool, SESSION)
        return frames, receive_staging.registration_message_hook(lambda _: frames, self.manager)

    def request(self, room, host_pages, device_pages=None, is_dummy=False):
        """(sglang's metadata frames, what the hooked builder returns) for a live room."""
        if room not in self.manager.request_status:
            self.manager.request_status[room] = KV_POLL_TRANSFERRING
        frames = TransferRequest(
            room=room,
            endpoint="127.0.0.1",
            port=17000,
            session_id=SESSION,
            host_pages=np.asarray(host_pages),
            device_pages=None if device_pages is None else np.asarray(device_pages),
        ).to_frames()
        hooked = receive_staging.metadata_message_hook(
            lambda _, **kwargs: frames,
            self.manager,
            bootstrap_room=room,
            required_dst_info_num=1,
            kv_indices=np.asarray(host_pages, dtype=np.int32),
            aux_index=0,
            state_indices=None,
            decode_prefix_len=0,
            is_dummy=is_dummy,
            device_kv_indices=None
            if device_pages is None
            else np.asarray(device_pages, dtype=np.int32),
        )
        return frames, hooked

    def reserve(self, room, host_pages, device_pages=None) -> Reservation | None:
        _, hooked = self.request(room, host_pages, device_pages)
        return Reservation.from_metadata(hooked, self.region.capability)

    def note(self, frames: list[bytes]):
        """A prefill's note through the hooked handler; the honest prefill that sent it will
        declare it in its status (`status`), whatever the decode made of it."""
        try:
            staged = Staged.from_frames(frames)
            sent = self.sent.setdefault((staged.room, staged.prefill_rank), {})
            sent[staged.reservation_id] = sent.get(staged.reservation_id, 0) + 1
        except Exception:  # not parseable: the test declares what its prefill sent
            pass

        def original(manager, msg):
            raise AssertionError(f"sglang's handle_chunk_ready got a staged note: {msg[:1]}")

        return receive_staging.chunk_ready_hook(original, self.manager, frames)

    def status(
        self, room, status, prefill_rank=0, log=None, applied=None, declared=None
    ) -> list[dict]:
        """A prefill rank's status through the hooked parser and handler; what sglang's got.

        The status declares `declared` ({reservation id: notes}; default: the
        notes `note` delivered for this room and rank; {} declares nothing;
        None sends sglang's plain frames). sglang's handler (the `original`)
        sets the room's status to the one it got, or to `applied` (a Success
        before the room's last rank: Transferring).
        """
        if declared is None and status == KV_POLL_SUCCESS:
            declared = self.sent.pop((room, prefill_rank), None)
        frames = [str(room).encode(), str(status).encode(), str(prefill_rank).encode()]
        if declared is not None:
            notes = {(DECODE_SESSION, reservation): n for reservation, n in declared.items()}
            frames += [b"", *declared_frames(notes)]
        parsed = receive_staging.status_message_hook(
            lambda _, msg: (room, status, prefill_rank, None), self.manager, frames
        )
        assert parsed == (room, status, prefill_rank, None)
        calls: list[dict] = []

        def original(manager, **kwargs):
            if log is not None:
                log.append("original")
            calls.append(kwargs)
            if kwargs["bootstrap_room"] in manager.request_status:  # sglang drops cleared rooms
                new = kwargs["status"] if applied is None else applied
                manager.request_status[kwargs["bootstrap_room"]] = new

        receive_staging.prefill_status_hook(
            original, self.manager, bootstrap_room=room, status=status, prefill_rank=prefill_rank
        )
        return calls


@pytest.fixture(autouse=True)
def staging_alone():
    """These tests check receive staging alone: the decode serves no other page size, so its
    registration carries no page size (`test_page_sizes_mooncake` checks that)."""
    page_sizes.decode_hooks_registered(False)
    yield
    page_sizes.decode_hooks_registered(True)


@pytest.fixture
def staging_bytes(monkeypatch):
    """Set the receive staging's size for the test (default REGION_BYTES)."""

    def set_bytes(nbytes: int) -> None:
        set_knob(monkeypatch, settings.RECEIVE_STAGING_BYTES.name, str(nbytes))
        settings.load()

    set_bytes(REGION_BYTES)
    return set_bytes


@pytest.fixture
def decodes(staging_bytes):
    made: list[Decode] = []

    def make(*args, **kwargs) -> Decode:
        made.append(Decode(*args, **kwargs))
        return made[-1]

    yield make
    for decode in made:
        receive_staging.REGIONS.release(decode.manager)
    prefill_routes.ROUTES.forget()


@pytest.fixture
def clock(monkeypatch):
    """The staging's monotonic clock, moved by the test."""
    now = SimpleNamespace(value=1000.0)
    monkeypatch.setattr(
        receive_staging, "time", SimpleNamespace(monotonic=lambda: now.value)
    )  # the staging's own `time` only: the rest of the process keeps the real clock
    return now


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def distinct_pages(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(POOL_PAGES)[:count].astype(np.int32)


def fill_region(region: receive_staging.ReceiveRegion, seed: int) -> np.ndarray:
    """Random bytes in the whole region (what a prefill wrote, and whatever else): a copy."""
    data = np.random.default_rng(seed).integers(0, 256, region.region.numel(), dtype=np.uint8)
    region.region.copy_(torch.from_numpy(data))
    return data


def note(room, reservation, chunks, entries=(0, 1, 2, 3), is_device=None, writers=1, writer=0,
         reservation_id=None, prefill_rank=None) -> list[bytes]:  # fmt: skip
    entries = np.asarray(entries, dtype=np.int64)
    return Staged(
        room=room,
        reservation_id=reservation.reservation_id if reservation_id is None else reservation_id,
        prefill_rank=writer if prefill_rank is None else prefill_rank,
        writer=writer,
        writers=writers,
        entries=entries,
        is_device=np.zeros(entries.size, bool) if is_device is None else np.asarray(is_device),
        chunks=np.asarray(chunks, dtype=np.int64).reshape(-1, 2),
    ).frames()


def reference(pool: Pool, kv: np.ndarray, region: np.ndarray, reservation, frames, host_pages,
              device_pages=None) -> np.ndarray:  # fmt: skip
    """`kv` after the note `frames` scattered, from the wire format's docstring, byte by byte."""
    staged = Staged.from_frames(frames)
    kv = kv.copy()
    writers, writer = staged.writers, staged.writer
    item_lens = pool.item_lens
    part = writer * (reservation.nbytes // writers)  # writer w owns [w R/W, (w+1) R/W)
    for first, count in staged.chunks.tolist():
        position = reservation.offset + part + first * sum(item_lens) // writers
        for entry, buffer in enumerate(staged.entries.tolist()):
            item_len = item_lens[buffer]
            token_len = item_len // PAGE_SIZE
            share = token_len // writers
            pages = device_pages if staged.is_device[entry] else host_pages
            for i in range(count):
                page = int(pages[first + i])
                for token in range(PAGE_SIZE):
                    source = position + i * (item_len // writers) + token * share
                    target = pool.offsets[buffer] + page * item_len + token * token_len
                    target += writer * share
                    kv[target : target + share] = region[source : source + share]
            position += count * (item_len // writers)
    return kv


def receive_fallbacks(reason: str) -> int:
    return counters.snapshot()["receive_staging_fallbacks"].get(reason, 0)


# region_for


def test_the_region_is_registered_once_and_advertised(decodes, staging_bytes):
    staging_bytes(REGION_BYTES + 100)  # rounded down to whole 256-byte parts
    decode = decodes()
    frames, first = decode.advertise()
    _, second = decode.advertise()
    region = decode.region
    assert region is receive_staging.region_for(decode.manager)
    assert region.region.numel() == REGION_BYTES and region.region.dtype == torch.uint8
    address = region.region.data_ptr()
    assert decode.engine.calls == [("register", address, REGION_BYTES)]
    assert first[: len(frames)] == frames and second == first
    assert Capability.from_registration(first) == Capability(address, REGION_BYTES)
    assert region.free_bytes == REGION_BYTES and region.lent_rooms == 0
    receive_staging.REGIONS.release(decode.manager)
    assert decode.engine.calls[-1] == ("deregister", address)
    assert decode.region is None


@pytest.mark.parametrize("nbytes", [0, ALIGNMENT - 1])
def test_staging_off_or_too_small_gives_no_region_and_sglangs_frames(
    decodes, staging_bytes, nbytes
):
    staging_bytes(nbytes)
    decode = decodes()
    frames, hooked = decode.advertise()
    assert hooked is frames
    assert receive_staging.region_for(decode.manager) is None
    assert decode.engine.calls == []
    sglang_frames, metadata = decode.request(5, distinct_pages(0, 4))
    assert metadata is sglang_frames


def test_sglangs_own_staging_gets_no_region(decodes):
    decode = decodes()
    decode.manager.enable_staging = True
    frames, hooked = decode.advertise()
    assert hooked is frames and decode.region is None and decode.engine.calls == []


def test_a_prefill_manager_gets_no_region(decodes):
    decode = decodes(mode="PREFILL")
    frames, hooked = decode.advertise()
    assert hooked is frames and decode.region is None and decode.engine.calls == []


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory"), MemoryError()])
def test_a_region_that_cannot_be_allocated_is_none(decodes, monkeypatch, error):
    def fail(nbytes, torch_device):
        raise error

    monkeypatch.setattr(cuda_runtime(), "empty_bytes", fail)
    decode = decodes()
    frames, hooked = decode.advertise()
    assert hooked is frames
    assert receive_staging.region_for(decode.manager) is None
    assert decode.engine.calls == []


def test_a_region_the_engine_cannot_register_is_none(decodes):
    decode = decodes(engine=FakeEngine(RuntimeError("Mooncake memory registration failed")))
    frames, hooked = decode.advertise()
    assert hooked is frames and decode.region is None
    assert [call[0] for call in decode.engine.calls] == ["register"]
    frames, again = decode.advertise()  # remembered: not tried again
    assert again is frames and len(decode.engine.calls) == 1


@pytest.mark.parametrize("error", [TypeError("'float' object cannot be interpreted"), OSError()])
def test_an_allocation_error_of_any_type_is_no_region_and_not_retried(decodes, monkeypatch, error):
    attempts = []

    def fail(nbytes, torch_device):
        attempts.append(nbytes)
        raise error

    monkeypatch.setattr(cuda_runtime(), "empty_bytes", fail)
    decode = decodes()
    frames, hooked = decode.advertise()  # no exception leaves the hook
    assert hooked is frames and decode.region is None
    _, again = decode.advertise()  # remembered: no second try on the next registration
    assert again == frames and attempts == [REGION_BYTES]


# Reservations


def test_the_same_room_asked_twice_gets_the_same_part(decodes):
    decode = decodes()
    decode.advertise()
    pages = distinct_pages(1, 5)
    first = decode.reserve(7, pages)
    assert first == decode.reserve(7, pages)
    assert (first.pages, first.nbytes, first.offset) == (5, 5 * PAGE_BYTES, 0)
    other = decode.reserve(8, distinct_pages(2, 3))
    assert other.reservation_id != first.reservation_id
    assert other.offset >= first.offset + aligned(first.nbytes)
    assert decode.region.lent_rooms == 2
    assert decode.region.free_bytes == REGION_BYTES - aligned(first.nbytes) - aligned(other.nbytes)
    _, changed = decode.request(7, distinct_pages(1, 6))  # the same room, other pages: a new
    renewed = Reservation.from_metadata(changed, decode.region.capability)  # request, a new part
    assert renewed.reservation_id not in (first.reservation_id, other.reservation_id)
    assert renewed.offset >= other.offset + aligned(other.nbytes)  # the first one is quarantined
    assert decode.region.lent_rooms == 3


def test_a_request_too_large_goes_as_today_and_is_counted(decodes):
    decode = decodes()
    decode.advertise()
    before = receive_fallbacks("receive staging full")
    pages = np.arange(REGION_BYTES // PAGE_BYTES + 1) % POOL_PAGES
    frames, hooked = decode.request(3, pages)
    assert hooked is frames
    assert receive_fallbacks("receive staging full") == before + 1
    assert decode.region.lent_rooms == 0 and decode.region.free_bytes == REGION_BYTES


def test_max_reservations_reached_goes_as_today_and_is_counted(decodes, staging_bytes):
    staging_bytes(2 * REGION_BYTES)  # bytes to spare: only the count of rooms is at its limit
    decode = decodes()
    decode.advertise()
    for room in range(receive_staging.MAX_RESERVATIONS):
        assert decode.reserve(room, [room % POOL_PAGES]) is not None
    before = receive_fallbacks("receive staging full")
    frames, hooked = decode.request(10_000, [0])
    assert hooked is frames
    assert receive_fallbacks("receive staging full") == before + 1
    assert decode.region.lent_rooms == receive_staging.MAX_RESERVATIONS
    free = 2 * REGION_BYTES - receive_staging.MAX_RESERVATIONS * ALIGNMENT
    assert decode.region.free_bytes == free > 0


def test_dummy_requests_get_nothing(decodes):
    decode = decodes()
    decode.advertise()
    before = receive_fallbacks("receive staging full")
    frames, hooked = decode.request(4, distinct_pages(0, 4), is_dummy=True)
    assert hooked is frames
    assert decode.region.lent_rooms == 0 and receive_fallbacks("receive staging full") == before


def test_no_region_advertised_lends_nothing(decodes):
    decode = decodes()
    frames, hooked = decode.request(4, distinct_pages(0, 4))  # never advertised: no region made
    assert hooked is frames and decode.region is None


class Request:
    """One request of a room, as its prefill (rank 0, honest) and the test see it."""

    def __init__(self, room: int, pages: np.ndarray, receiver, reservation) -> None:
        self.room, self.pages, self.receiver, self.reservation = room, pages, receiver, reservation
        self.sent = 0  # pages sent so far (staged or direct), in order
        self.notes = 0  # staged notes the prefill sent (and declares)
        self.lost = False  # a note it sent never arrived
        self.landed: dict[tuple[int, int], bytes] = {}  # (buffer, page position): its bytes
        self.ended = False  # failed, aborted, timed out or cleared
        self.concluded = False  # its prefill sent its status: it sends nothing more


def open_request(decode: Decode, room: int, pages: np.ndarray) -> Request:
    """sglang's decode opens a request of `room` (a real receiver) and sends its metadata."""
    manager = decode.manager
    receiver = conn.MooncakeKVReceiver(manager, "127.0.0.1:8998", room)
    manager.required_prefill_response_num_table[room] = 1
    receiver.init_time = 0.0  # metadata sent long ago (sglang's `init`): a timeout step fires
    return Request(room, pages, receiver, decode.reserve(room, pages))


def page_bytes(pool: Pool, kv: np.ndarray, buffer: int, page: int) -> bytes:
    return kv[pool.page(buffer, page)].tobytes()


ROOM_STEPS = ["open"] * 3 + ["stage"] * 3 + ["direct", "lose", "stale", "success"] * 2
ROOM_STEPS += ["abort", "timeout", "clear", "clear", "tick", "wait out"]
SENDS = ("stage", "lose", "direct")  # a chunk: staged, staged with its note lost, direct
ROOMS = [0] * 6 + [1] * 4 + [2] * 2 + list(range(3, 16))  # 16 rooms, a few busy ones
room_steps = st.lists(
    st.tuples(st.sampled_from(ROOM_STEPS), st.sampled_from(ROOMS), st.integers(1, 3)),
    min_size=20,
    max_size=80,
)


@hypothesis_settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=room_steps)
@example(steps=[("open", 0, 2), ("stage", 0, 1), ("lose", 0, 1), ("success", 0, 1)])
@example(  # the reuse: request 1 aborted, cleared; request 2 of the room, as many pages
    steps=[("open", 0, 2), ("stage", 0, 2), ("abort", 0, 1), ("clear", 0, 1), ("open", 0, 2)]
    + [("stale", 0, 1), ("stage", 0, 2), ("success", 0, 1), ("clear", 0, 1)]
)
@example(
    steps=[("open", 1, 2), ("stage", 1, 1), ("timeout", 1, 1), ("stale", 1, 1), ("clear", 1, 1)]
    + [("open", 1, 2), ("direct", 1, 1), ("stage", 1, 1), ("stale", 1, 1), ("success", 1, 1)]
)
def test_no_room_succeeds_without_its_bytes_and_every_part_comes_back(staging_bytes, clock, steps):
    """Random interleavings of lend, staged and direct chunks, lost and stale notes, status,
    abort, waiting timeout, clear and reuse over 16 rooms (sglang's own receiver and status
    code, hooked). After each step the pool holds exactly what the rules let land (no stale
    note scatters, nothing outside a live request's pages), no two lendings share a byte of
    the region, every Success has every byte its prefill sent, and at the end every part is
    back."""
    staging_bytes(16 * 1024)
    clock.value = 1000.0
    decode = Decode(seed=1)
    manager = decode.manager
    rng = np.random.default_rng(7)
    try:
        decode.advertise()
        region = decode.region
        expected = decode.pool.bytes()  # what the pool must hold
        live: dict[int, Request] = {}
        ended: list[Request] = []
        free_pages = list(range(POOL_PAGES))
        for kind, room, count in steps:
            request = live.get(room)
            if kind in ("tick", "wait out"):
                clock.value += 1.0 if kind == "tick" else longest_hold()
            elif kind == "open" and request is None and len(free_pages) >= count:
                pages = np.array(
                    [free_pages.pop(rng.integers(len(free_pages))) for _ in range(count)]
                )
                live[room] = open_request(decode, room, pages.astype(np.int32))
            elif request is None or (request.concluded and kind in SENDS + ("success",)):
                pass
            elif kind in SENDS and request.sent < len(request.pages):
                first, count = request.sent, min(count, len(request.pages) - request.sent)
                request.sent += count
                if kind == "direct" or request.reservation is None:  # the prefill's own RDMA
                    kv = decode.pool.tensor.numpy()
                    for buffer in range(len(ITEM_LENS)):
                        for position in range(first, first + count):
                            page = decode.pool.page(buffer, int(request.pages[position]))
                            data = rng.integers(0, 256, page.stop - page.start, dtype=np.uint8)
                            kv[page] = data
                            expected[page] = data
                    continue
                reservation = request.reservation
                start = reservation.offset + first * PAGE_BYTES
                data = rng.integers(0, 256, count * PAGE_BYTES, dtype=np.uint8)
                region.region[start : start + data.size] = torch.from_numpy(data)
                frames = note(room, reservation, [(first, count)])
                request.notes += 1
                landed = reference(decode.pool, expected, region.region.numpy(), reservation,
                                   frames, request.pages)  # fmt: skip
                for buffer in range(len(ITEM_LENS)):
                    for position in range(first, first + count):
                        page = int(request.pages[position])
                        request.landed[buffer, position] = page_bytes(
                            decode.pool, landed, buffer, page
                        )
                if kind == "lose":
                    request.lost = True
                    continue
                decode.note(frames)
                if not request.ended:
                    expected = landed
            elif kind == "stale":
                old = next((r for r in reversed(ended) if r.room == room and r.reservation), None)
                if old is not None:
                    decode.note(note(room, old.reservation, [(0, 1)]))  # its prefill, late
            elif kind == "success":
                declared = None if request.reservation is None else {
                    request.reservation.reservation_id: request.notes
                }  # fmt: skip
                was = manager.request_status.get(room)
                frames = [str(room).encode(), str(KV_POLL_SUCCESS).encode(), b"0"]
                if declared is not None:
                    notes = {(DECODE_SESSION, k): v for k, v in declared.items()}
                    frames += [b"", *declared_frames(notes)]
                parsed = conn.MooncakeKVManager.parse_kv_status_message(manager, frames)  # hooked
                conn.MooncakeKVManager.apply_prefill_status(
                    manager, bootstrap_room=parsed[0], status=parsed[1], prefill_rank=parsed[2]
                )
                request.concluded = True
                now = manager.request_status.get(room)
                if now == KV_POLL_SUCCESS:
                    assert was != KV_POLL_FAILED and not request.lost and not request.ended
                    kv = decode.pool.tensor.numpy()
                    for (buffer, position), data in request.landed.items():
                        page = int(request.pages[position])
                        assert page_bytes(decode.pool, kv, buffer, page) == data
                else:  # honest, in time, nothing lost: only a failed request fails
                    assert request.lost or request.ended or was == KV_POLL_FAILED
            elif kind == "abort":
                request.receiver.abort()
                request.ended = True
            elif kind == "timeout":  # opened long ago (init_time 0): past sglang's 300 s
                assert request.receiver._check_waiting_timeout() == KV_POLL_FAILED
                request.ended = True
            elif kind == "clear":
                request.receiver.clear()
                request.ended = True
                ended.append(live.pop(room))
                free_pages.extend(int(page) for page in request.pages)
            np.testing.assert_array_equal(decode.pool.bytes(), expected)
            check_parts(region)
            held = [r.reservation.reservation_id for r in live.values() if r.reservation]
            assert len(held) == len(set(held))
        for request in list(live.values()):
            request.receiver.clear()
        clock.value += longest_hold()
        region.reserve(manager.request_status, 10**6, np.zeros(0, np.int64), None)  # a sweep
        assert region.lent_rooms == 0 and region.free_bytes == region.region.numel()
    finally:
        receive_staging.REGIONS.release(manager)


def check_parts(region: receive_staging.ReceiveRegion) -> None:
    """No two lendings share a byte; lent and free bytes add up to the region."""
    parts = sorted(
        (lending.reservation.offset, aligned(lending.reservation.nbytes))
        for lending in region._lendings.values()
    )
    assert all(a + n <= b for (a, n), (b, _) in zip(parts[:-1], parts[1:], strict=True))
    assert all(a >= 0 and a + n <= region.region.numel() for a, n in parts)
    assert region.free_bytes + sum(n for _, n in parts) == region.region.numel()


# Lifecycle


def test_success_frees_the_part_at_once(decodes):
    decode = decodes()
    decode.advertise()
    reservation = decode.reserve(7, distinct_pages(0, 6))
    assert decode.region.free_bytes == REGION_BYTES - aligned(reservation.nbytes)
    calls = decode.status(7, KV_POLL_SUCCESS)
    assert calls == [dict(bootstrap_room=7, status=KV_POLL_SUCCESS, prefill_rank=0)]
    assert decode.region.lent_rooms == 0 and decode.region.free_bytes == REGION_BYTES
    assert decode.reserve(8, distinct_pages(0, 6)).offset == reservation.offset  # reusable


def test_success_of_one_of_two_ranks_keeps_the_part(decodes):
    decode = decodes()
    decode.advertise()
    decode.reserve(7, distinct_pages(0, 6))
    decode.status(7, KV_POLL_SUCCESS, applied=KV_POLL_TRANSFERRING)  # one rank of two
    assert decode.region.lent_rooms == 1
    decode.status(7, KV_POLL_SUCCESS, prefill_rank=1)
    assert decode.region.lent_rooms == 0


def longest_hold() -> float:
    """How long an ended lending waits at most: no prefill status ever concluded it."""
    return receive_staging.NO_STATUS_HOLDS * receive_staging.failed_hold_s()


def test_a_failed_room_is_held_until_the_hold_after_its_prefill_status(
    decodes, clock, staging_bytes
):
    staging_bytes(8 * ALIGNMENT)
    decode = decodes()
    decode.advertise()
    pages = np.arange(8 * ALIGNMENT // PAGE_BYTES)  # 10 pages: 1920 bytes, the whole region
    reservation = decode.reserve(7, pages)
    assert decode.region.free_bytes == 0
    assert decode.status(7, KV_POLL_FAILED)[0]["status"] == KV_POLL_FAILED
    clock.value += receive_staging.failed_hold_s() - 1
    assert decode.reserve(8, pages) is None  # not reusable while a failed write may land
    assert decode.reserve(7, pages) is None  # nor by the room itself
    assert decode.region.lent_rooms == 1
    clock.value += 1
    again = decode.reserve(9, pages)  # the sweep of this reserve freed it
    assert again is not None and again.offset == reservation.offset
    assert again.reservation_id != reservation.reservation_id
    assert decode.region.lent_rooms == 1


def test_an_ended_room_waits_for_its_prefill_status_not_for_a_clock(decodes, clock):
    """The decode gives up on a room (abort, waiting timeout, clear) while its prefill may
    still be writing: the part is held past any hold until the prefill's status says its
    writes ended; after a Failed status, for the hold after it."""
    decode = decodes()
    decode.advertise()
    decode.reserve(7, distinct_pages(0, 4))
    del decode.manager.request_status[7]  # cleared: no status reached the decode
    decode.reserve(8, distinct_pages(0, 4))  # the sweep that sees it gone ends it
    clock.value += 5 * receive_staging.failed_hold_s()
    decode.reserve(9, distinct_pages(0, 4))
    assert decode.region.lent_rooms == 3  # 7 held: its prefill has not reported
    decode.status(7, KV_POLL_FAILED)  # the prefill's send ended, failed
    clock.value += receive_staging.failed_hold_s() - 1
    decode.reserve(10, distinct_pages(0, 4))
    assert decode.region.lent_rooms == 4
    clock.value += 1
    decode.reserve(11, distinct_pages(0, 4))
    assert decode.region.lent_rooms == 4  # 7 freed, 11 lent


def test_an_ended_room_whose_ranks_all_succeeded_is_freed_at_once(decodes, clock):
    """Two prefill ranks; the decode aborted the room first. One rank's Success holds it (the
    other may still write); both: every write ended cleanly, freed without a hold."""
    decode = decodes()
    decode.advertise()
    decode.manager.required_prefill_response_num_table[7] = 2
    decode.reserve(7, distinct_pages(0, 4))
    decode.manager.request_status[7] = KV_POLL_FAILED  # sglang's abort
    decode.status(7, KV_POLL_SUCCESS, prefill_rank=0, applied=KV_POLL_FAILED)  # Failed sticks
    decode.reserve(8, distinct_pages(0, 4))
    assert decode.region.lent_rooms == 2
    decode.status(7, KV_POLL_SUCCESS, prefill_rank=1, applied=KV_POLL_FAILED)
    decode.reserve(9, distinct_pages(0, 4))
    assert decode.region.lent_rooms == 2  # 7 freed, 8 and 9 lent


def test_a_room_no_prefill_ever_concludes_is_freed_after_the_longest_hold(decodes, clock):
    decode = decodes()
    decode.advertise()
    decode.reserve(7, distinct_pages(0, 4))
    del decode.manager.request_status[7]
    clock.value += 10 * longest_hold()  # long after: the sweep that sees it gone starts it
    decode.reserve(8, distinct_pages(0, 4))
    assert decode.region.lent_rooms == 2
    clock.value += longest_hold()
    decode.reserve(9, distinct_pages(0, 4))
    assert decode.region.lent_rooms == 2  # 7 freed, 9 lent


# Notes: hostile and malformed


REQUEST_PAGES = 6


def hostile_cases():
    """(prelude notes, the hostile note) as functions of (room, reservation)."""
    last = REQUEST_PAGES
    return {
        "writers changed, 2 then 1": (
            [lambda room, r: note(room, r, [(0, 2)], writers=2)],
            lambda room, r: note(room, r, [(2, 2)]),
        ),
        "writers changed, 1 then 2": (
            [lambda room, r: note(room, r, [(0, 2)])],
            lambda room, r: note(room, r, [(2, 2)], writers=2, writer=1),
        ),
        "entry past the KV buffers": ([], lambda room, r: note(room, r, [(0, 2)], [0, 4])),
        "pages past the reservation": ([], lambda room, r: note(room, r, [(last - 1, 2)])),
        "a page start at the end": ([], lambda room, r: note(room, r, [(last, 1)])),
        "no pages": ([], lambda room, r: note(room, r, [(0, 0)])),
        "a good chunk, then a bad one": ([], lambda room, r: note(room, r, [(0, 2), (4, 9)])),
        "the same pages twice in a note": ([], lambda room, r: note(room, r, [(0, 3), (2, 1)])),
        "the same pages twice": (
            [lambda room, r: note(room, r, [(0, 3)])],
            lambda room, r: note(room, r, [(2, 2)]),
        ),
        "device entries without device pages": (
            [],
            lambda room, r: note(room, r, [(0, 2)], is_device=[False, False, True, False]),
        ),
        "item lengths 3 writers cannot split": (
            [],
            lambda room, r: note(room, r, [(0, 2)], writers=3, writer=2),
        ),
        "item lengths 16 writers cannot split": (
            [],
            lambda room, r: note(room, r, [(0, 2)], writers=16, writer=0),
        ),
    }


@pytest.mark.parametrize("case", list(hostile_cases()))
def test_a_hostile_note_writes_nothing_and_fails_the_room(decodes, case):
    prelude, hostile = hostile_cases()[case]
    decode = decodes()
    decode.advertise()
    room = 41
    reservation = decode.reserve(room, distinct_pages(3, REQUEST_PAGES))
    fill_region(decode.region, seed=9)
    for make in prelude:
        assert decode.note(make(room, reservation)) is True
    before, refused = decode.pool.bytes(), receive_fallbacks("staged chunk refused")
    assert decode.note(hostile(room, reservation)) is True
    np.testing.assert_array_equal(decode.pool.bytes(), before)  # nothing scattered
    assert receive_fallbacks("staged chunk refused") == refused + 1
    [call] = decode.status(room, KV_POLL_SUCCESS)
    assert call["status"] == KV_POLL_FAILED
    assert call["failure_reason"].startswith("gpu_planner:")
    assert decode.manager.request_status[room] == KV_POLL_FAILED
    assert decode.region.lent_rooms == 1  # quarantined, not freed


def test_a_note_naming_another_rooms_part_scatters_nothing_and_fails_both(decodes):
    """Room 42's prefill says it staged into room 41's part: 42's pages never got those bytes,
    and 41's part may hold 42's: neither request counts its KV as arrived."""
    decode = decodes()
    decode.advertise()
    reservation = decode.reserve(41, distinct_pages(3, REQUEST_PAGES))
    fill_region(decode.region, seed=2)
    before = decode.pool.bytes()
    decode.manager.request_status[42] = KV_POLL_TRANSFERRING
    assert decode.note(note(42, reservation, [(0, 2)])) is True
    np.testing.assert_array_equal(decode.pool.bytes(), before)
    [call] = decode.status(42, KV_POLL_SUCCESS)
    assert call["status"] == KV_POLL_FAILED and "does not hold" in call["failure_reason"]
    [call] = decode.status(41, KV_POLL_SUCCESS, declared={})
    assert call["status"] == KV_POLL_FAILED and "room 42" in call["failure_reason"]


def test_a_note_for_a_reservation_the_request_does_not_hold_fails_it(decodes):
    """A note naming a reservation this decode never lent (or freed) scatters nothing; the
    prefill's declaration of it fails the request: its chunk did not reach its pages."""
    decode = decodes()
    decode.advertise()
    reservation = decode.reserve(41, distinct_pages(3, REQUEST_PAGES))
    fill_region(decode.region, seed=2)
    before, dropped = decode.pool.bytes(), receive_fallbacks("staged note for no live lending")
    stale = note(41, reservation, [(0, 2)], reservation_id=reservation.reservation_id ^ 1)
    assert decode.note(stale) is True
    np.testing.assert_array_equal(decode.pool.bytes(), before)
    assert receive_fallbacks("staged note for no live lending") == dropped + 1
    [call] = decode.status(41, KV_POLL_SUCCESS)
    assert call["status"] == KV_POLL_FAILED and "does not hold" in call["failure_reason"]


def test_a_note_for_a_quarantined_room_is_ignored(decodes):
    decode = decodes()
    decode.advertise()
    reservation = decode.reserve(41, distinct_pages(3, REQUEST_PAGES))
    decode.status(41, KV_POLL_FAILED)
    fill_region(decode.region, seed=2)
    before = decode.pool.bytes()
    assert decode.note(note(41, reservation, [(0, 2)])) is True
    np.testing.assert_array_equal(decode.pool.bytes(), before)
    assert decode.region.lent_rooms == 1


def test_a_note_for_a_room_sglang_cleared_writes_nothing(decodes):
    decode = decodes()
    decode.advertise()
    reservation = decode.reserve(41, distinct_pages(3, REQUEST_PAGES))
    fill_region(decode.region, seed=2)
    before = decode.pool.bytes()
    del decode.manager.request_status[41]  # cleared: its pages may already hold another request
    assert decode.note(note(41, reservation, [(0, 2)])) is True
    np.testing.assert_array_equal(decode.pool.bytes(), before)


@pytest.mark.parametrize(
    "frames",
    [
        [STAGED_TAG],
        [STAGED_TAG, b"garbage"],
        [STAGED_TAG, *[b"\xff" * 5] * 7],
        [STAGED_TAG, b"41", b"1", b"0", b"1", b"\x00\x00\x00", b"\x00", b"\x00" * 16],
        [STAGED_TAG, b"41", b"1", b"1", b"1", b"\x00" * 4, b"\x00", b"\x00" * 16],
        [STAGED_TAG, b"41", b"1", b"0", b"1", b"\x00" * 4, b"\x00", b"\x00" * 16, b"extra"],
        [STAGED_TAG, "41", b"1", b"0", b"1", b"\x00" * 4, b"\x00", b"\x00" * 16],
    ],
)
def test_a_malformed_note_scatters_nothing_and_never_passes_as_arrived(decodes, frames):
    """One that names the lent room fails it; one that names none is counted, and the
    prefill's declaration of the note it sent fails the request."""
    decode = decodes()
    decode.advertise()
    reservation = decode.reserve(41, distinct_pages(3, REQUEST_PAGES))
    fill_region(decode.region, seed=2)
    before, malformed = decode.pool.bytes(), receive_fallbacks("staged note malformed")
    assert decode.note(frames) is True
    np.testing.assert_array_equal(decode.pool.bytes(), before)
    names_the_room = len(frames) > 1 and frames[1] == b"41"
    assert receive_fallbacks("staged note malformed") == malformed + (not names_the_room)
    [call] = decode.status(41, KV_POLL_SUCCESS, declared={reservation.reservation_id: 1})
    assert call["status"] == KV_POLL_FAILED
    expected = "does not parse" if names_the_room else "declared 1 staged chunks, 0 arrived"
    assert expected in call["failure_reason"]


def test_a_malformed_declaration_fails_the_ranks_success(decodes):
    decode = decodes()
    decode.advertise()
    decode.reserve(41, distinct_pages(3, REQUEST_PAGES))
    frames = [b"41", b"4", b"0", b"", DECLARED_TAG, b"127.0.0.1:1", b"\x01"]
    receive_staging.status_message_hook(lambda _, msg: (41, 4, 0, None), decode.manager, frames)
    calls = []
    receive_staging.prefill_status_hook(
        lambda manager, **kwargs: calls.append(kwargs), decode.manager,
        bootstrap_room=41, status=KV_POLL_SUCCESS, prefill_rank=0,
    )  # fmt: skip
    assert calls[0]["status"] == KV_POLL_FAILED and "declaration" in calls[0]["failure_reason"]


@pytest.mark.parametrize(
    "message",
    [[b"CHUNK_READY", b"1", b"0", b"0", b"2", b"w"], [b"17", b"4", b"0"], [], (STAGED_TAG,)],
)
def test_a_message_without_our_tag_goes_to_sglang(decodes, message):
    decode = decodes()
    decode.advertise()
    got, result = [], object()

    def original(manager, msg):
        got.append((manager, msg))
        return result

    assert receive_staging.chunk_ready_hook(original, decode.manager, message) is result
    assert got == [(decode.manager, message)]


# Notes: what a valid one scatters


def test_whole_pages_land_by_each_buffers_page_space(decodes):
    """W = 1, HiSparse: buffers 2 and 3 take the device pages, 0 and 1 the host pages."""
    decode = decodes(seed=5, device_buffers=2)
    decode.advertise()
    host_pages = distinct_pages(11, REQUEST_PAGES)
    device_pages = distinct_pages(12, REQUEST_PAGES)
    assert (host_pages != device_pages).any()
    reservation = decode.reserve(7, host_pages, device_pages)
    staged = fill_region(decode.region, seed=6)
    entries, is_device = [2, 0, 3, 1], [True, False, True, False]  # any order, buffer-major
    notes = [
        note(7, reservation, [(0, 4)], entries, is_device),
        note(7, reservation, [(4, 1), (5, 1)], entries, is_device),
    ]
    expected = decode.pool.bytes()
    scatters = counters.snapshot()["staged_scatters"]
    for frames in notes:
        expected = reference(
            decode.pool, expected, staged, reservation, frames, host_pages, device_pages
        )
        assert decode.note(frames) is True
        np.testing.assert_array_equal(decode.pool.bytes(), expected)
    assert counters.snapshot()["staged_scatters"] == scatters + 3
    assert not np.array_equal(expected, Pool(ITEM_LENS, seed=5).bytes())  # bytes moved
    [call] = decode.status(7, KV_POLL_SUCCESS)
    assert call["status"] == KV_POLL_SUCCESS and "failure_reason" not in call
    assert decode.region.lent_rooms == 0 and decode.region.free_bytes == REGION_BYTES


def test_two_writers_each_fill_their_half_of_every_token_slot(decodes):
    decode = decodes(seed=7)
    decode.advertise()
    host_pages = distinct_pages(13, REQUEST_PAGES)
    reservation = decode.reserve(9, host_pages)
    staged = fill_region(decode.region, seed=8)
    first = note(9, reservation, [(0, 2), (2, 4)], writers=2, writer=0)
    second = note(9, reservation, [(0, 6)], [3, 1, 0, 2], writers=2, writer=1)
    kv = decode.pool.bytes()
    after_first = reference(decode.pool, kv, staged, reservation, first, host_pages)
    after_second = reference(decode.pool, after_first, staged, reservation, second, host_pages)
    assert decode.note(first) is True
    np.testing.assert_array_equal(decode.pool.bytes(), after_first)
    assert decode.note(second) is True
    np.testing.assert_array_equal(decode.pool.bytes(), after_second)
    # Every byte of the request's pages came from the region; no other page changed.
    landed = decode.pool.bytes()
    for buffer, item_len in enumerate(ITEM_LENS):
        pages = landed[decode.pool.offsets[buffer] : decode.pool.offsets[buffer + 1]]
        pages = pages.reshape(POOL_PAGES, item_len)
        original = kv[decode.pool.offsets[buffer] : decode.pool.offsets[buffer + 1]]
        original = original.reshape(POOL_PAGES, item_len)
        others = np.setdiff1d(np.arange(POOL_PAGES), host_pages)
        np.testing.assert_array_equal(pages[others], original[others])
    decode.status(9, KV_POLL_SUCCESS, prefill_rank=0, applied=KV_POLL_TRANSFERRING)
    assert decode.region.lent_rooms == 1
    [call] = decode.status(9, KV_POLL_SUCCESS, prefill_rank=1)
    assert call["status"] == KV_POLL_SUCCESS
    assert decode.region.lent_rooms == 0


# CUDA host logic, through the stand-in


def test_on_a_gpu_the_region_and_scatter_run_on_the_kvs_device(decodes, host_cuda, monkeypatch):
    decode = decodes(seed=3)
    host_cuda.place(decode.pool.tensor, 1)
    log: list = []
    scatter = receive_staging.scatter_head_slices

    def recorded_scatter(*args, **kwargs):
        log.append(("scatter", host_cuda.current_device()))
        return scatter(*args, **kwargs)

    new_event = host_cuda.new_event

    def recorded_event():
        event = new_event()
        record, synchronize = event.record, event.synchronize

        def record_on(stream=None):
            log.append(("record", host_cuda.current_device()))
            record(stream)

        def wait():
            log.append("synchronize")
            synchronize()

        event.record, event.synchronize = record_on, wait
        return event

    monkeypatch.setattr(receive_staging, "scatter_head_slices", recorded_scatter)
    monkeypatch.setattr(host_cuda, "new_event", recorded_event)
    decode.advertise()
    region = decode.region
    assert region.torch_device == torch.device("cuda", 1)
    assert host_cuda.allocations == [(torch.device("cuda", 1), 1)]
    host_pages = distinct_pages(4, REQUEST_PAGES)
    reservation = decode.reserve(5, host_pages)
    staged = fill_region(region, seed=4)
    frames = note(5, reservation, [(0, REQUEST_PAGES)])
    expected = reference(decode.pool, decode.pool.bytes(), staged, reservation, frames, host_pages)
    assert decode.note(frames) is True
    assert log == [("scatter", 1), ("record", 1)]
    assert host_cuda.current_device() == 0  # the guard ended
    [call] = decode.status(5, KV_POLL_SUCCESS, log=log)
    assert log == [("scatter", 1), ("record", 1), "synchronize", "original"]
    assert call["status"] == KV_POLL_SUCCESS
    np.testing.assert_array_equal(decode.pool.bytes(), expected)
    assert region.lent_rooms == 0


def test_a_scatter_that_cannot_be_waited_for_fails_the_room(decodes, host_cuda, monkeypatch):
    decode = decodes(seed=3)
    host_cuda.place(decode.pool.tensor, 1)
    new_event = host_cuda.new_event

    def broken_event():
        event = new_event()

        def fail():
            raise RuntimeError("an illegal memory access was encountered")

        event.synchronize = fail
        return event

    monkeypatch.setattr(host_cuda, "new_event", broken_event)
    decode.advertise()
    reservation = decode.reserve(5, distinct_pages(4, REQUEST_PAGES))
    fill_region(decode.region, seed=4)
    assert decode.note(note(5, reservation, [(0, 2)])) is True
    [call] = decode.status(5, KV_POLL_SUCCESS)  # no exception leaves the hook
    assert call["status"] == KV_POLL_FAILED
    assert call["failure_reason"].startswith("gpu_planner: a scatter failed")
    assert decode.region.lent_rooms == 1  # quarantined


@pytest.mark.parametrize("devices", [(0, 1), (None, 1)])
def test_kv_on_two_devices_or_host_and_gpu_gets_no_region(decodes, host_cuda, devices):
    decode = decodes()
    half = decode.pool.offsets[2]
    for device, tensor in zip(devices, (decode.pool.tensor[:half], decode.pool.tensor[half:]),
                              strict=True):  # fmt: skip
        if device is not None:
            host_cuda.place(tensor, device)
    frames, hooked = decode.advertise()
    assert hooked is frames and decode.region is None and host_cuda.allocations == []
    why = receive_staging.receive_device(SimpleNamespace(kv_data_ptrs=decode.pool.ptrs))
    assert (why == receive_staging.HOST_AND_GPU_REFUSAL) == (devices[0] is None)


# The prefill's parser hooks


REGISTRATION_FROM_ZMQ = inspect.unwrap(conn.KVArgsRegisterInfo.from_zmq)
TRANSFER_FROM_ZMQ = inspect.unwrap(conn.TransferInfo.from_zmq)
CAPABILITY = Capability(1 << 40, 1 << 20)


@pytest.fixture
def prefill():
    yield
    prefill_routes.ROUTES.forget()


def registered(pool_frames: list[bytes], extra: list[bytes]):
    before = counters.snapshot()["fallbacks"].get("staging advertisement ignored", 0)
    msg = pool_frames + extra
    info = prefill_routes.registration_info_hook(
        REGISTRATION_FROM_ZMQ, conn.KVArgsRegisterInfo, msg
    )
    ignored = counters.snapshot()["fallbacks"].get("staging advertisement ignored", 0) - before
    return info, ignored


def test_a_capability_is_kept_per_decode_session(prefill):
    frames = registration_frames(Pool(ITEM_LENS, 0), SESSION)
    info, ignored = registered(frames, CAPABILITY.frames())
    assert info == REGISTRATION_FROM_ZMQ(conn.KVArgsRegisterInfo, frames)
    assert prefill_routes.ROUTES.capability(SESSION) == CAPABILITY and ignored == 0
    registered(frames, [])  # a plain registration from the same session: forgotten
    assert prefill_routes.ROUTES.capability(SESSION) is None


@pytest.mark.parametrize(
    "extra",
    [
        [CAPABILITY.frames()[0], b"\x01" * 15],
        [CAPABILITY.frames()[0]],
        CAPABILITY.frames() * 2,
        [CAPABILITY.frames()[0], bytes(16)],
    ],
)
def test_a_hostile_capability_is_ignored_and_the_peer_forgotten(prefill, extra):
    frames = registration_frames(Pool(ITEM_LENS, 0), SESSION)
    registered(frames, CAPABILITY.frames())
    info, ignored = registered(frames, extra)  # never raises
    assert info == REGISTRATION_FROM_ZMQ(conn.KVArgsRegisterInfo, frames)
    assert ignored == 1 and prefill_routes.ROUTES.capability(SESSION) is None


def transfer_message(room: int, pages: np.ndarray, extra: list[bytes], dummy=False) -> list:
    frames = TransferRequest(
        room=room, endpoint="127.0.0.1", port=17000, session_id=SESSION, host_pages=pages
    ).to_frames()
    if dummy:
        frames[4] = frames[5] = b""
    return frames + extra


def parsed(msg: list[bytes]):
    before = counters.snapshot()["fallbacks"].get("staging reservation ignored", 0)
    info = prefill_routes.transfer_info_hook(TRANSFER_FROM_ZMQ, conn.TransferInfo, msg)
    ignored = counters.snapshot()["fallbacks"].get("staging reservation ignored", 0) - before
    return info, ignored


def test_a_reservation_gives_the_request_a_route(prefill):
    registered(registration_frames(Pool(ITEM_LENS, 0), SESSION), CAPABILITY.frames())
    pages = distinct_pages(0, 10)
    reservation = Reservation(3, 4096, 10 * PAGE_BYTES, 10)
    info, ignored = parsed(transfer_message(77, pages, reservation.frames()))
    assert ignored == 0
    np.testing.assert_array_equal(info.dst_kv_indices, pages)
    route, first = prefill_routes.ROUTES.route_for(info.dst_kv_indices)
    assert first == 0
    assert (route.room, route.session, route.endpoint, route.port) == (
        77,
        SESSION,
        "127.0.0.1",
        17000,
    )
    assert route.region == CAPABILITY and route.reservation == reservation
    assert prefill_routes.ROUTES.route_for(info.dst_kv_indices[3:7]) == (route, 3)
    assert prefill_routes.ROUTES.route_for(info.dst_kv_indices[2:][1:3]) == (route, 3)
    assert prefill_routes.ROUTES.route_for(info.dst_kv_indices[9:]) == (route, 9)
    assert prefill_routes.ROUTES.route_for(info.dst_kv_indices[3:7].copy()) is None
    assert prefill_routes.ROUTES.route_for(info.dst_kv_indices[::2]) is None
    assert prefill_routes.ROUTES.route_for(info.dst_kv_indices[1::3]) is None
    assert prefill_routes.ROUTES.route_for(info.dst_kv_indices.view(np.uint32)[3:7]) is None
    assert prefill_routes.ROUTES.route_for(info.dst_kv_indices.astype(np.int64)[3:7]) is None
    assert prefill_routes.ROUTES.route_for(pages[3:7]) is None  # the same pages, another array
    del info, route
    gc.collect()
    assert prefill_routes.ROUTES.lent_requests == 0  # forgotten with its TransferInfo


@pytest.mark.parametrize(
    ("reservation", "pages"),
    [
        (Reservation(3, CAPABILITY.nbytes - 256, 512, 10), 10),  # past the advertised region
        (Reservation(3, 0, 10 * PAGE_BYTES, 9), 10),  # lent for 9 pages, the request has 10
        (Reservation(3, 0, 10 * PAGE_BYTES, 11), 10),
    ],
)
def test_a_reservation_that_does_not_fit_records_no_route(prefill, reservation, pages):
    registered(registration_frames(Pool(ITEM_LENS, 0), SESSION), CAPABILITY.frames())
    msg = transfer_message(77, distinct_pages(0, pages), reservation.frames())
    info, ignored = parsed(msg)
    assert ignored == 1
    assert info.room == 77 and not info.is_dummy  # sglang's parse, unchanged
    np.testing.assert_array_equal(info.dst_kv_indices, distinct_pages(0, pages))
    assert (
        prefill_routes.ROUTES.lent_requests == 0
        and prefill_routes.ROUTES.route_for(info.dst_kv_indices) is None
    )


def test_no_route_without_a_capability_or_for_a_dummy(prefill):
    reservation = Reservation(3, 0, 10 * PAGE_BYTES, 10)
    info, ignored = parsed(transfer_message(77, distinct_pages(0, 10), reservation.frames()))
    assert (
        ignored == 0 and prefill_routes.ROUTES.route_for(info.dst_kv_indices) is None
    )  # unknown peer
    registered(registration_frames(Pool(ITEM_LENS, 0), SESSION), CAPABILITY.frames())
    info, ignored = parsed(transfer_message(78, distinct_pages(0, 10), [], dummy=False))
    assert prefill_routes.ROUTES.lent_requests == 0  # no reservation frames
    dummy = transfer_message(79, distinct_pages(0, 10), reservation.frames(), dummy=True)
    info, ignored = parsed(dummy)
    assert info.is_dummy and prefill_routes.ROUTES.lent_requests == 0 and ignored == 0


def test_the_status_and_chunk_hooks_pass_an_unhashable_managers_calls_to_sglang():
    """sglang's unit tests call these on `SimpleNamespace` managers, which no weak key holds."""
    import types

    manager = types.SimpleNamespace(request_status={})
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "sglang's"

    assert (
        receive_staging.prefill_status_hook(
            original, manager, bootstrap_room=1, status=4, prefill_rank=0
        )
        == "sglang's"
    )
    assert calls == [((manager,), {"bootstrap_room": 1, "status": 4, "prefill_rank": 0})]
    assert receive_staging.chunk_ready_hook(original, manager, [STAGED_TAG]) is True
    assert receive_staging.chunk_ready_hook(original, manager, [b"CHUNK_READY"]) == "sglang's"


@pytest.mark.parametrize(
    "where",
    [
        "a KV buffer's base",  # the region holds the first KV buffer's base
        "inside a first page",  # the region starts inside a KV buffer's first page
    ],
)
def test_a_region_overlapping_the_decodes_kv_is_ignored(prefill, where):
    pool = Pool(ITEM_LENS, 0)
    frames = registration_frames(pool, SESSION)
    address = pool.ptrs[0] - 256 if where == "a KV buffer's base" else pool.ptrs[1] + 8
    info, ignored = registered(frames, Capability(address, 4096).frames())
    assert info == REGISTRATION_FROM_ZMQ(conn.KVArgsRegisterInfo, frames)
    assert ignored == 1 and prefill_routes.ROUTES.capability(SESSION) is None


def test_a_prefills_success_declares_its_notes_per_lent_request(prefill):
    """The prefill's status hook: a Success names, per decode session, each lent request of
    the room and how many notes it sent; other statuses and unlent rooms are sglang's."""
    from sglang_plugin_support import make_manager

    registered(registration_frames(Pool(ITEM_LENS, 0), SESSION), CAPABILITY.frames())
    reservation = Reservation(3, 4096, 10 * PAGE_BYTES, 10)
    info, _ = parsed(transfer_message(77, distinct_pages(0, 10), reservation.frames()))
    route, _ = prefill_routes.ROUTES.route_for(info.dst_kv_indices)
    route.staged_notes = 2
    manager = make_manager(None)
    manager.transfer_infos = {77: {SESSION: info}}

    def encode(room, status):
        def original(manager, **kwargs):
            return [str(room).encode(), str(status).encode(), b"0"]

        return prefill_routes.status_message_hook(
            original, manager, bootstrap_room=room, status=status, failure_reason=None
        )

    success = encode(77, KV_POLL_SUCCESS)
    assert success[:4] == [b"77", b"4", b"0", b""]  # sglang reads an empty reason at frame 3
    assert declared_notes(success, SESSION) == {3: 2}
    assert declared_notes(success, "127.0.0.1:1") == {}
    assert encode(77, KV_POLL_FAILED) == [b"77", b"0", b"0"]
    assert encode(78, KV_POLL_SUCCESS) == [b"78", b"4", b"0"]  # no lent request: plain

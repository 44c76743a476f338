"""Receive staging's wire format (`staging_wire`): round trips, and every hostile frame refused.

Everything these parsers read comes from another process, so each malformed
or hostile input must raise `FrameError` naming the field at fault (and never
another exception type), and a plain sglang message (no tag) reads as None.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from gpu_planner.inputs import INT64_MAX
from gpu_planner.integration.sglang.frames import MAX_RANKS, FrameError
from gpu_planner.integration.sglang.staging_wire import (
    CAPABILITY_TAG,
    DECLARED_TAG,
    MAX_ENTRIES,
    RESERVATION_TAG,
    SGLANG_METADATA_FRAMES,
    SGLANG_REGISTRATION_FRAMES,
    STAGED_FRAMES,
    STAGED_TAG,
    Capability,
    Reservation,
    Staged,
    chunk_offset,
    declared_frames,
    declared_notes,
    writer_part,
)

SGLANG_REGISTRATION = [f"registration {i}".encode() for i in range(SGLANG_REGISTRATION_FRAMES)]
SGLANG_METADATA = [f"metadata {i}".encode() for i in range(SGLANG_METADATA_FRAMES)]
REGION = Capability(address=1 << 32, nbytes=1 << 20)


def registration(*extra: bytes) -> list[bytes]:
    return [*SGLANG_REGISTRATION, *extra]


def metadata(*extra: bytes) -> list[bytes]:
    return [*SGLANG_METADATA, *extra]


def staged(**changes) -> Staged:
    fields = dict(
        room=123456789,
        reservation_id=7,
        prefill_rank=5,
        writer=1,
        writers=2,
        entries=np.array([3, 0, 2], dtype=np.int64),
        is_device=np.array([False, True, False]),
        chunks=np.array([[0, 4], [4, 2]], dtype=np.int64),
    )
    fields.update(changes)
    return Staged(**fields)


def staged_frames(**replaced: bytes) -> list[bytes]:
    """A valid note's frames with some replaced, by field name."""
    names = ["tag", "room", "reservation_id", "prefill_rank", "writer", "writers", "entries"]
    names += ["is_device", "chunks"]
    frames = staged().frames()
    for name, frame in replaced.items():
        frames[names.index(name)] = frame
    return frames


def assert_same_staged(parsed: Staged, expected: Staged) -> None:
    fields = ("room", "reservation_id", "prefill_rank", "writer", "writers")
    assert [getattr(parsed, name) for name in fields] == [
        getattr(expected, name) for name in fields
    ]
    np.testing.assert_array_equal(parsed.entries, expected.entries)
    np.testing.assert_array_equal(parsed.is_device, expected.is_device)
    np.testing.assert_array_equal(parsed.chunks, expected.chunks)
    assert parsed.entries.dtype == np.int64 and parsed.chunks.dtype == np.int64
    assert parsed.is_device.dtype == bool and parsed.chunks.shape == expected.chunks.shape


# Capability


@pytest.mark.parametrize(
    ("address", "nbytes"), [(1, 1), (0x7F00_0000_0000, 256 << 20), (INT64_MAX - 8, 8)]
)
def test_a_capability_round_trips_after_sglangs_registration(address, nbytes):
    capability = Capability(address, nbytes)
    frames = registration(*capability.frames())
    assert frames[SGLANG_REGISTRATION_FRAMES] == CAPABILITY_TAG
    assert Capability.from_registration(frames) == capability


def test_a_plain_sglang_registration_has_no_capability():
    assert Capability.from_registration(registration()) is None
    assert Capability.from_registration(registration(b"some later frame", b"")) is None


def test_a_tag_inside_sglangs_own_frames_is_not_read():
    frames = list(SGLANG_REGISTRATION)
    frames[3:5] = [CAPABILITY_TAG, struct.pack("<QQ", 4096, 4096)]
    assert Capability.from_registration(frames) is None


@pytest.mark.parametrize("size", [0, 8, 15, 17, 24])
def test_a_capability_of_the_wrong_length_names_the_region(size):
    with pytest.raises(FrameError, match=f"receive staging region: {size} bytes, expected 16"):
        Capability.from_registration(registration(CAPABILITY_TAG, b"\x01" * size))


def test_a_capability_tag_twice_is_refused():
    frame = struct.pack("<QQ", 4096, 4096)
    with pytest.raises(FrameError, match="gpu_planner.receive_staging/2: the tag must appear once"):
        Capability.from_registration(registration(CAPABILITY_TAG, frame, CAPABILITY_TAG, frame))


def test_a_capability_tag_with_nothing_after_it_is_refused():
    with pytest.raises(FrameError, match="gpu_planner.receive_staging/2"):
        Capability.from_registration(registration(CAPABILITY_TAG))


@pytest.mark.parametrize(
    ("address", "nbytes"),
    [(0, 4096), (4096, 0), (0, 0), (INT64_MAX, 1), (INT64_MAX - 4095, 4096), (1 << 62, 1 << 62)],
)
def test_a_capability_that_is_not_a_region_is_refused(address, nbytes):
    frame = struct.pack("<QQ", address, nbytes)
    with pytest.raises(FrameError, match=f"receive staging: {nbytes} bytes at {address}"):
        Capability.from_registration(registration(CAPABILITY_TAG, frame))


@pytest.mark.parametrize(
    ("values", "index"), [((1 << 63, 4096), 0), ((4096, 1 << 63), 1), ((2**64 - 1, 2**64 - 1), 0)]
)
def test_capability_values_of_2_63_or_more_are_refused(values, index):
    with pytest.raises(FrameError, match=rf"receive staging region\[{index}\] = {values[index]}"):
        Capability.from_registration(registration(CAPABILITY_TAG, struct.pack("<QQ", *values)))


@pytest.mark.parametrize(
    "frames",
    [
        (*SGLANG_REGISTRATION, CAPABILITY_TAG, "not bytes"),
        [*SGLANG_REGISTRATION[:5], None, CAPABILITY_TAG, struct.pack("<QQ", 1, 1)],
        [*SGLANG_REGISTRATION, CAPABILITY_TAG, bytearray(16)],
    ],
)
def test_a_registration_that_is_not_a_list_of_bytes_is_refused(frames):
    with pytest.raises(FrameError, match="not a list of bytes frames"):
        Capability.from_registration(frames)


# Reservation


@pytest.mark.parametrize(
    "reservation",
    [
        Reservation(1, 0, 4096, 4),
        Reservation(INT64_MAX, 1024, REGION.nbytes - 1024, 1),
        Reservation(2, REGION.nbytes, 0, 0),
    ],
)
def test_a_reservation_round_trips_after_sglangs_metadata(reservation):
    frames = metadata(*reservation.frames())
    assert frames[SGLANG_METADATA_FRAMES] == RESERVATION_TAG
    assert Reservation.from_metadata(frames, REGION) == reservation


def test_plain_sglang_metadata_has_no_reservation():
    assert Reservation.from_metadata(metadata(), REGION) is None
    frames = list(SGLANG_METADATA)
    frames[9] = RESERVATION_TAG  # in sglang's own frames: not ours
    assert Reservation.from_metadata([*frames, Reservation(1, 0, 1, 1).frames()[1]], REGION) is None


@pytest.mark.parametrize(
    ("offset", "nbytes"),
    [
        (0, REGION.nbytes + 1),
        (REGION.nbytes, 1),
        (REGION.nbytes - 255, 256),
        (INT64_MAX, INT64_MAX),
    ],
)
def test_a_reservation_outside_the_region_is_refused(offset, nbytes):
    frames = metadata(RESERVATION_TAG, struct.pack("<4Q", 9, offset, nbytes, 1))
    with pytest.raises(FrameError, match=f"reservation 9: {nbytes} bytes at offset {offset}"):
        Reservation.from_metadata(frames, REGION)


@pytest.mark.parametrize("size", [0, 16, 31, 33, 40])
def test_a_reservation_of_the_wrong_length_is_refused(size):
    with pytest.raises(FrameError, match=f"reservation: {size} bytes, expected 32"):
        Reservation.from_metadata(metadata(RESERVATION_TAG, b"\x00" * size), REGION)


@pytest.mark.parametrize("index", range(4))
def test_reservation_values_of_2_63_or_more_are_refused(index):
    values = [1, 0, 256, 1]
    values[index] = 1 << 63
    with pytest.raises(FrameError, match=rf"reservation\[{index}\] = {1 << 63}"):
        Reservation.from_metadata(metadata(RESERVATION_TAG, struct.pack("<4Q", *values)), REGION)


def test_a_reservation_tag_twice_or_last_is_refused():
    frame = Reservation(1, 0, 256, 1).frames()[1]
    with pytest.raises(FrameError, match="gpu_planner.reservation/2"):
        Reservation.from_metadata(metadata(RESERVATION_TAG, frame, RESERVATION_TAG, frame), REGION)
    with pytest.raises(FrameError, match="gpu_planner.reservation/2"):
        Reservation.from_metadata(metadata(RESERVATION_TAG), REGION)


# Staged


def test_a_staged_note_round_trips():
    note = staged()
    frames = note.frames()
    assert len(frames) == STAGED_FRAMES and frames[0] == STAGED_TAG
    assert_same_staged(Staged.from_frames(frames), note)


def test_a_staged_note_round_trips_at_its_limits():
    note = staged(
        room=2**64 - 1,
        reservation_id=INT64_MAX,
        writer=MAX_RANKS - 1,
        writers=MAX_RANKS,
        entries=np.arange(MAX_ENTRIES, dtype=np.int64)[::-1],
        is_device=np.arange(MAX_ENTRIES) % 2 == 0,
        chunks=np.array([[1 << 40, 1 << 40], [0, 0]], dtype=np.int64),
    )
    assert_same_staged(Staged.from_frames(note.frames()), note)
    entries = staged(entries=np.array([2**32 - 1]), is_device=np.array([True]))
    assert_same_staged(Staged.from_frames(entries.frames()), entries)


@pytest.mark.parametrize("count", [0, 1, STAGED_FRAMES - 1, STAGED_FRAMES + 1])
def test_a_staged_note_of_the_wrong_frame_count_is_refused(count):
    frames = (staged().frames() + [b"1"] * 8)[:count]
    with pytest.raises(FrameError, match=f"expected {STAGED_FRAMES} frames"):
        Staged.from_frames(frames)


def test_a_staged_note_that_is_not_a_list_is_refused():
    with pytest.raises(FrameError, match="not a staged message"):
        Staged.from_frames(tuple(staged().frames()))
    with pytest.raises(FrameError, match="not a staged message"):
        Staged.from_frames(b"".join(staged().frames()))


@pytest.mark.parametrize("tag", [b"gpu_planner.staged/1", b"CHUNK_READY", b"", CAPABILITY_TAG])
def test_a_staged_note_with_another_tag_is_refused(tag):
    with pytest.raises(FrameError, match="wrong tag"):
        Staged.from_frames(staged_frames(tag=tag))


@pytest.mark.parametrize("position", range(1, STAGED_FRAMES))
@pytest.mark.parametrize("make", [bytearray, memoryview, lambda frame: frame.decode("latin-1")])
def test_a_staged_note_with_a_frame_that_is_not_bytes_is_refused(position, make):
    frames = staged().frames()
    frames[position] = make(frames[position])
    with pytest.raises(FrameError, match="non-bytes frames"):
        Staged.from_frames(frames)


@pytest.mark.parametrize("writers", [b"0", b"-1", str(MAX_RANKS + 1).encode(), b"two", b""])
def test_staged_writers_out_of_range_are_refused(writers):
    with pytest.raises(FrameError, match="^writers"):
        Staged.from_frames(staged_frames(writers=writers, writer=b"0"))


@pytest.mark.parametrize(("writer", "writers"), [(b"1", b"1"), (b"2", b"2"), (b"-1", b"2")])
def test_a_staged_writer_outside_its_writers_is_refused(writer, writers):
    with pytest.raises(FrameError, match="^writer = "):
        Staged.from_frames(staged_frames(writer=writer, writers=writers))


@pytest.mark.parametrize(
    "entries",
    [b"", b"\x01\x00\x00", b"\x01\x00\x00\x00\x02", np.array([1, 2, 1], "<u4").tobytes()],
)
def test_staged_entries_empty_partial_or_duplicated_are_refused(entries):
    count = max(len(entries) // 4, 1)
    with pytest.raises(FrameError, match="^entries"):
        Staged.from_frames(staged_frames(entries=entries, is_device=b"\x00" * count))


def test_more_than_max_entries_are_refused():
    entries = np.arange(MAX_ENTRIES + 1, dtype="<u4").tobytes()
    with pytest.raises(FrameError, match="^entries: more than 65536"):
        Staged.from_frames(staged_frames(entries=entries, is_device=bytes(MAX_ENTRIES + 1)))


@pytest.mark.parametrize("is_device", [b"", b"\x00\x01", b"\x00\x00\x00\x00", b"\x00\x02\x00"])
def test_staged_is_device_of_the_wrong_length_or_not_0_1_is_refused(is_device):
    with pytest.raises(FrameError, match="^is_device"):
        Staged.from_frames(staged_frames(is_device=is_device))


@pytest.mark.parametrize("size", [0, 8, 15, 17, 40])
def test_staged_chunks_not_whole_pairs_are_refused(size):
    with pytest.raises(FrameError, match=f"^chunks: {size} bytes"):
        Staged.from_frames(staged_frames(chunks=b"\x00" * size))


@pytest.mark.parametrize(
    "chunk", [((1 << 40) + 1, 1), (0, (1 << 40) + 1), (2**63, 1), (1, 2**64 - 1), (2**64 - 1, 0)]
)
def test_staged_chunks_with_huge_values_are_refused(chunk):
    chunks = np.array([[0, 1], chunk], dtype="<u8").tobytes()
    with pytest.raises(FrameError, match="^chunks: a page position or count past 2\\*\\*40"):
        Staged.from_frames(staged_frames(chunks=chunks))


@pytest.mark.parametrize(
    "room", [b"", b"abc", b"1e3", b" 1", b"1 ", b"0x10", b"-1", b"\xff", str(2**64).encode()]
)
def test_a_staged_room_that_is_not_a_u64_decimal_is_refused(room):
    with pytest.raises(FrameError, match="^room"):
        Staged.from_frames(staged_frames(room=room))


@pytest.mark.parametrize("reservation_id", [b"", b"x", b"-2", str(2**63).encode(), b"1" * 41])
def test_a_staged_reservation_id_out_of_range_is_refused(reservation_id):
    with pytest.raises(FrameError, match="^reservation_id"):
        Staged.from_frames(staged_frames(reservation_id=reservation_id))


def check_in_range(note: Staged) -> None:
    """Every field of a parsed note is in its documented range."""
    assert 0 <= note.room < 2**64
    assert 0 <= note.reservation_id <= INT64_MAX
    assert 0 <= note.prefill_rank <= MAX_RANKS**3
    assert 1 <= note.writers <= MAX_RANKS and 0 <= note.writer < note.writers
    assert note.entries.dtype == np.int64 and note.entries.ndim == 1
    assert 1 <= note.entries.size <= MAX_ENTRIES
    assert np.unique(note.entries).size == note.entries.size
    assert (note.entries >= 0).all() and (note.entries < 2**32).all()
    assert note.is_device.dtype == bool and note.is_device.shape == note.entries.shape
    assert note.chunks.dtype == np.int64 and note.chunks.ndim == 2 and note.chunks.shape[1] == 2
    assert note.chunks.shape[0] >= 1
    assert (note.chunks >= 0).all() and (note.chunks <= 1 << 40).all()


# Mostly byte edits inside a frame, so that a good share still parses (and is range-checked).
MUTATIONS = ["flip"] * 4 + ["insert", "delete", "replace"] * 2 + ["frames", "type", "tag"]
BYTE_VALUES = st.one_of(st.integers(ord("0"), ord("9")), st.integers(0, 2), st.integers(0, 255))
NOT_BYTES = [bytearray, memoryview, lambda frame: frame.decode("latin-1"), lambda frame: None]


@st.composite
def mutated_frames(draw) -> list:
    entries = draw(st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True))
    chunks = draw(
        st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99)), min_size=1, max_size=4)
    )
    note = staged(
        room=draw(st.integers(0, 2**64 - 1)),
        reservation_id=draw(st.integers(0, INT64_MAX)),
        prefill_rank=draw(st.integers(0, MAX_RANKS**3)),
        writer=0,
        writers=draw(st.integers(1, 8)),
        entries=np.array(entries, dtype=np.int64),
        is_device=np.array(
            draw(st.lists(st.booleans(), min_size=len(entries), max_size=len(entries)))
        ),
        chunks=np.array(chunks, dtype=np.int64),
    )
    frames: list = note.frames()
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(MUTATIONS))
        if kind == "frames":
            if draw(st.booleans()) and frames:
                del frames[draw(st.integers(0, len(frames) - 1))]
            else:
                frames.insert(draw(st.integers(0, len(frames))), draw(st.binary(max_size=24)))
            continue
        if len(frames) < 2:
            continue
        # The tag only by its own mutation: a wrong tag is refused before any field is read.
        index = 0 if kind == "tag" else draw(st.sampled_from(range(1, len(frames))))
        frame = frames[index]
        if kind == "type":
            if isinstance(frame, bytes):
                frames[index] = draw(st.sampled_from(NOT_BYTES))(frame)
            continue
        if not isinstance(frame, bytes):
            continue
        data = bytearray(frame)
        if kind in ("flip", "tag") and data:
            position = draw(st.integers(0, len(data) - 1))
            data[position] = draw(BYTE_VALUES)
        elif kind == "insert":
            position = draw(st.integers(0, len(data)))
            data[position:position] = draw(st.binary(min_size=1, max_size=9))
        elif kind == "delete" and data:
            start = draw(st.integers(0, len(data) - 1))
            data[start : start + draw(st.integers(1, 9))] = b""
        elif kind == "replace":
            data = bytearray(draw(st.binary(max_size=40)))
        frames[index] = bytes(data)
    return frames


@hypothesis_settings(max_examples=300)
@given(frames=mutated_frames())
def test_a_mutated_staged_note_parses_in_range_or_raises_frame_error(frames):
    try:
        note = Staged.from_frames(frames)
    except FrameError:
        return
    check_in_range(note)


@pytest.mark.parametrize("rank", [b"", b"x", b"-1", str(MAX_RANKS**3 + 1).encode()])
def test_a_staged_prefill_rank_out_of_range_is_refused(rank):
    with pytest.raises(FrameError, match="^prefill_rank"):
        Staged.from_frames(staged_frames(prefill_rank=rank))


@pytest.mark.parametrize(
    ("frames", "room"),
    [
        (staged_frames(writers=b"0"), 123456789),  # a damaged note still names its room
        ([STAGED_TAG, b"41"], 41),
        ([STAGED_TAG, b"x41", b"1"], None),
        ([STAGED_TAG, "41"], None),  # not bytes: not from ZMQ
        ([STAGED_TAG], None),
        ([b"gpu_planner.staged/1", b"41"], None),  # another version's tag
        ("not frames", None),
    ],
)
def test_the_room_a_damaged_note_names(frames, room):
    assert Staged.room_named(frames) == room


# What a Success status declares


STATUS = [b"41", b"4", b"0", b""]  # sglang's frames: room, status, rank, reason


def test_a_declaration_round_trips_per_decode_session():
    notes = {("127.0.0.1:1", 7): 3, ("127.0.0.1:2", 9): 0, ("127.0.0.1:1", 8): 1}
    frames = STATUS + declared_frames(notes)
    assert declared_notes(frames, "127.0.0.1:1") == {7: 3, 8: 1}
    assert declared_notes(frames, "127.0.0.1:2") == {9: 0}
    assert declared_notes(frames, "127.0.0.1:3") == {}  # it declares nothing toward this decode
    assert declared_notes(STATUS, "127.0.0.1:1") is None  # a plain sglang prefill
    assert declared_notes(STATUS[:3], "127.0.0.1:1") is None


@pytest.mark.parametrize(
    "tail",
    [
        [DECLARED_TAG],  # nothing after the tag
        [DECLARED_TAG, b"127.0.0.1:1"],
        [DECLARED_TAG, b"127.0.0.1:1", b"\x00" * 15],  # counts not whole pairs
        [DECLARED_TAG, b"a\nb", b"\x00" * 16],  # two sessions, one pair
        [DECLARED_TAG, b"s", (1 << 63).to_bytes(8, "little") + bytes(8)],  # id past 2**63
        [DECLARED_TAG, b"s\ns", bytes(32)],  # one reservation declared twice
        [*declared_frames({("s", 1): 1}), *declared_frames({("s", 2): 1})],  # the tag twice
    ],
)
def test_a_malformed_declaration_is_refused(tail):
    with pytest.raises(FrameError, match="declared"):
        declared_notes(STATUS + tail, "s")


# Where a writer's bytes go


def test_writer_part_by_hand():
    # A reservation of 6 pages of 1536 bytes (every buffer's page bytes): 9216 bytes.
    assert writer_part(9216, 1, 0) == (0, 9216)
    assert writer_part(9216, 2, 0) == (0, 4608)
    assert writer_part(9216, 2, 1) == (4608, 4608)
    assert writer_part(9216, 4, 3) == (6912, 2304)
    assert writer_part(9216, 3, 2) == (6144, 3072)


def test_chunk_offset_by_hand():
    assert chunk_offset(1536, 1, 0) == 0
    assert chunk_offset(1536, 1, 5) == 5 * 1536
    assert chunk_offset(1536, 2, 3) == 3 * 768
    assert chunk_offset(1536, 4, 1) == 384


@pytest.mark.parametrize("writers", [1, 2, 4, 8])
def test_writer_parts_tile_the_reservation_and_chunks_stay_in_their_part(writers):
    page_bytes, pages = 256 * 8, 5
    reservation = page_bytes * pages
    parts = [writer_part(reservation, writers, writer) for writer in range(writers)]
    assert parts[0][0] == 0
    assert all(
        offset + size == nxt for (offset, size), (nxt, _) in zip(parts[:-1], parts[1:], strict=True)
    )
    assert parts[-1][0] + parts[-1][1] == reservation
    # The last page's chunk of a writer ends exactly at the end of its part.
    last = chunk_offset(page_bytes, writers, pages - 1) + page_bytes // writers
    assert last == parts[0][1]

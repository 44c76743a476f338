"""Receive staging's wire format: what two gpu_planner peers add to sglang's ZMQ messages.

Three pieces, each tagged and versioned, so that a plain sglang peer never
sees a frame it reads and a gpu_planner peer never acts on one it does not
recognise:

- `Capability` (decode -> prefill), appended after the 20 frames of sglang's
  KV registration (`build_receiver_registration_message`): the tag, then the
  decode's receive-staging region as `<QQ` (address, bytes). sglang's
  `KVArgsRegisterInfo.from_zmq` reads frames 0-19 only.
- `Reservation` (decode -> prefill), appended after the 10 frames of sglang's
  per-request metadata (`build_receiver_metadata_message`): the tag, then
  `<QQQQ` (reservation id, offset in the region, bytes, pages). sglang's
  `TransferInfo.from_zmq` reads frames 0-9 only.
- `Staged` (prefill -> decode), a message of its own on the ZMQ socket that
  carries sglang's status messages, sent after the writes it names ended and
  so before that prefill rank's status: which prefill rank wrote which pages
  of every decode buffer (and which head share) into the reservation.
- `Declared` (prefill -> decode), appended to a prefill rank's Success status
  (after sglang's frames, which the decode's parser reads up to frame 3): the
  tag, the decode sessions joined by newlines, then `<QQ` (reservation id,
  notes) per session: how many `Staged` notes the rank sent for each lent
  request the status concludes (one prefill rank may conclude to several
  decode ranks). Every chunk the rank sent that no note names went direct into
  the request's pages, so the decode counts a request's KV as arrived only
  when every declared note arrived and scattered (`receive_staging`).

Version 2 (every tag ends in /2) added the prefill rank to `Staged` and the
`Declared` count; a peer speaking another version sees no tag it knows and
sends or receives as plain sglang.

Where the bytes go (both peers compute it; the decode never takes an offset
from the wire): a reservation of `P` pages holds `P * sum(item_lens)` bytes
(every decode KV buffer's page bytes). With `W` writers (prefill ranks that
each hold `1/W` of every decode token: TP-down; 1 otherwise) writer `w` owns
bytes `[w * R/W, (w+1) * R/W)`; its chunk of pages `[a, a+n)` starts `a *
sum(item_lens)/W` bytes into its part and holds its entries buffer-major,
each entry's `n` staged pages of `item_lens[e]/W` bytes in page order.

Everything parsed here comes from another process: each parser checks frame
counts, lengths and ranges and raises `FrameError` naming the field.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from gpu_planner.inputs import INT64_MAX
from gpu_planner.integration.sglang.frames import (
    MAX_RANKS,
    SGLANG_REGISTRATION_FRAMES,
    FrameError,
    parse_int,
)

CAPABILITY_TAG = b"gpu_planner.receive_staging/2"
RESERVATION_TAG = b"gpu_planner.reservation/2"
STAGED_TAG = b"gpu_planner.staged/2"
DECLARED_TAG = b"gpu_planner.declared/2"
SGLANG_METADATA_FRAMES = 10  # TransferInfo.from_zmq reads frames 0-9
SGLANG_STATUS_FRAMES = 4  # parse_kv_status_message reads room, status, rank, reason
STAGED_FRAMES = 9
MAX_ENTRIES = 1 << 16  # decode KV buffers: far beyond any model
KV_POLL_FAILED, KV_POLL_SUCCESS = 0, 4  # sglang's KVPoll values, as its status messages carry
MAX_DECLARED = 1 << 10  # reservations one status declares: one per decode rank it concludes


def tag_position(frames: list[bytes], first: int, tag: bytes) -> int | None:
    """Where `tag` stands among `frames[first:]`, None when absent; `FrameError` when it
    stands twice or the frames are not bytes."""
    if not isinstance(frames, list) or not all(isinstance(frame, bytes) for frame in frames):
        raise FrameError("not a list of bytes frames")
    positions = [i for i in range(first, len(frames)) if frames[i] == tag]
    if len(positions) > 1:
        raise FrameError(f"{tag.decode()}: the tag must appear once")
    return positions[0] if positions else None


def tagged_frame(frames: list[bytes], first: int, tag: bytes) -> bytes | None:
    """The frame after `tag` among `frames[first:]`, None when `tag` is absent.

    `FrameError` when the tag appears twice or has nothing after it.
    """
    position = tag_position(frames, first, tag)
    if position is None:
        return None
    if position + 1 >= len(frames):
        raise FrameError(f"{tag.decode()}: the tag must be followed by its frame")
    return frames[position + 1]


def _u64s(frame: bytes, count: int, field: str) -> tuple[int, ...]:
    if len(frame) != 8 * count:
        raise FrameError(f"{field}: {len(frame)} bytes, expected {8 * count}")
    values = struct.unpack(f"<{count}Q", frame)
    for name_index, value in enumerate(values):
        if value > INT64_MAX:
            raise FrameError(f"{field}[{name_index}] = {value}: must be below 2**63")
    return values


@dataclass(frozen=True)
class Capability:
    """A decode's receive-staging region, as its registration advertises it."""

    address: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.address <= 0 or self.nbytes <= 0 or self.address + self.nbytes > INT64_MAX:
            raise FrameError(
                f"receive staging: {self.nbytes} bytes at {self.address} is not a region"
            )

    def frames(self) -> list[bytes]:
        """The frames to append to sglang's registration message."""
        return [CAPABILITY_TAG, struct.pack("<QQ", self.address, self.nbytes)]

    @classmethod
    def from_registration(cls, frames: list[bytes]) -> Capability | None:
        """The capability a registration carries; None for a plain sglang decode."""
        frame = tagged_frame(frames, SGLANG_REGISTRATION_FRAMES, CAPABILITY_TAG)
        if frame is None:
            return None
        return cls(*_u64s(frame, 2, "receive staging region"))


@dataclass(frozen=True)
class Reservation:
    """Part of a decode's region lent to one request: `nbytes` at `offset`, for `pages` pages."""

    reservation_id: int
    offset: int
    nbytes: int
    pages: int

    def frames(self) -> list[bytes]:
        """The frames to append to sglang's per-request metadata message."""
        values = (self.reservation_id, self.offset, self.nbytes, self.pages)
        return [RESERVATION_TAG, struct.pack("<4Q", *values)]

    @classmethod
    def from_metadata(cls, frames: list[bytes], region: Capability) -> Reservation | None:
        """The reservation a request's metadata carries, checked to lie inside `region`."""
        frame = tagged_frame(frames, SGLANG_METADATA_FRAMES, RESERVATION_TAG)
        if frame is None:
            return None
        reservation = cls(*_u64s(frame, 4, "reservation"))
        if reservation.offset + reservation.nbytes > region.nbytes:
            raise FrameError(
                f"reservation {reservation.reservation_id}: {reservation.nbytes} bytes at "
                f"offset {reservation.offset} end past the {region.nbytes}-byte region"
            )
        return reservation


def writer_part(reservation_bytes: int, writers: int, writer: int) -> tuple[int, int]:
    """(offset, bytes) of writer `writer`'s part of a reservation shared by `writers`."""
    part = reservation_bytes // writers
    return writer * part, part


def chunk_offset(page_bytes: int, writers: int, page_start: int) -> int:
    """Where a writer's chunk starting at page `page_start` begins in its part.

    `page_bytes` is the decode's bytes per page over all its KV buffers.
    """
    return page_start * (page_bytes // writers)


@dataclass(frozen=True)
class Staged:
    """One prefill rank's note that it wrote `chunks` of its head slice into a reservation.

    `prefill_rank` is the rank as its status names it (sglang's
    `_prefill_unique_rank`); `entries` are decode KV buffer indices (into its
    registered `kv_data_ptrs`) in the order their staged pages lie in each
    chunk; `is_device[i]` says entry `i` takes the request's device pages
    (HiSparse), else its host pages; each chunk is (first page, pages) in the
    request's page positions.
    """

    room: int
    reservation_id: int
    prefill_rank: int
    writer: int
    writers: int
    entries: np.ndarray  # int64 [entries]
    is_device: np.ndarray  # bool [entries]
    chunks: np.ndarray  # int64 [chunks, 2]: page_start, num_pages

    def frames(self) -> list[bytes]:
        return [
            STAGED_TAG,
            str(self.room).encode("ascii"),
            str(self.reservation_id).encode("ascii"),
            str(self.prefill_rank).encode("ascii"),
            str(self.writer).encode("ascii"),
            str(self.writers).encode("ascii"),
            np.asarray(self.entries, dtype="<u4").tobytes(),
            np.asarray(self.is_device, dtype=np.uint8).tobytes(),
            np.asarray(self.chunks, dtype="<u8").tobytes(),
        ]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> Staged:
        """Parse `frames()` output; `FrameError` names the field at fault."""
        if not isinstance(frames, list) or len(frames) != STAGED_FRAMES:
            raise FrameError(f"not a staged message: expected {STAGED_FRAMES} frames")
        if not all(isinstance(frame, bytes) for frame in frames) or frames[0] != STAGED_TAG:
            raise FrameError("not a staged message: wrong tag or non-bytes frames")
        writers = parse_int(frames[5], "writers", 1, MAX_RANKS)
        entries_frame, device_frame, chunks_frame = frames[6:]
        if len(entries_frame) % 4 or not entries_frame:
            raise FrameError(f"entries: {len(entries_frame)} bytes is not whole u32 values")
        entries = np.frombuffer(entries_frame, dtype="<u4").astype(np.int64)
        if entries.size > MAX_ENTRIES or np.unique(entries).size != entries.size:
            raise FrameError("entries: more than 65536, or an entry listed twice")
        if len(device_frame) != entries.size or set(device_frame) - {0, 1}:
            raise FrameError("is_device: expected one byte of 0 or 1 per entry")
        if len(chunks_frame) % 16 or not chunks_frame:
            raise FrameError(f"chunks: {len(chunks_frame)} bytes is not whole (u64, u64) pairs")
        chunks = np.frombuffer(chunks_frame, dtype="<u8").reshape(-1, 2)
        if (chunks > np.uint64(1 << 40)).any():
            raise FrameError("chunks: a page position or count past 2**40")
        return cls(
            room=parse_int(frames[1], "room", 0, 2**64 - 1),
            reservation_id=parse_int(frames[2], "reservation_id", 0, INT64_MAX),
            prefill_rank=parse_int(frames[3], "prefill_rank", 0, MAX_RANKS**3),
            writer=parse_int(frames[4], "writer", 0, writers - 1),
            writers=writers,
            entries=entries,
            is_device=np.frombuffer(device_frame, dtype=np.uint8).astype(bool),
            chunks=chunks.astype(np.int64),
        )

    @staticmethod
    def room_named(frames: object) -> int | None:
        """The room a note that does not parse still names in its room frame, or None."""
        if not isinstance(frames, list) or len(frames) < 2 or frames[0] != STAGED_TAG:
            return None
        if not isinstance(frames[1], bytes):
            return None
        try:
            return parse_int(frames[1], "room", 0, 2**64 - 1)
        except FrameError:
            return None


def declared_frames(notes: dict[tuple[str, int], int]) -> list[bytes]:
    """`Declared`: frames to append to a Success status, {(decode session, reservation id):
    notes sent} for every lent request the status concludes."""
    sessions = b"\n".join(session.encode("ascii") for session, _ in notes)
    values = [value for (_, reservation), count in notes.items() for value in (reservation, count)]
    return [DECLARED_TAG, sessions, struct.pack(f"<{len(values)}Q", *values)]


def declared_notes(status_frames: list[bytes], session: str) -> dict[int, int] | None:
    """{reservation id: notes the rank sent} a status declares toward decode `session`.

    None for a status without a declaration (a plain sglang prefill); {} when
    it declares nothing toward this decode; `FrameError` when malformed.
    """
    position = tag_position(status_frames, SGLANG_STATUS_FRAMES - 1, DECLARED_TAG)
    if position is None:
        return None
    if position + 2 >= len(status_frames):
        raise FrameError("declared: the tag must be followed by its sessions and counts")
    sessions, counts = status_frames[position + 1], status_frames[position + 2]
    names = sessions.split(b"\n") if sessions else []
    if len(names) > MAX_DECLARED or len(counts) != 16 * len(names):
        raise FrameError(f"declared: {len(names)} sessions, {len(counts)} bytes of counts")
    values = _u64s(counts, 2 * len(names), "declared")
    declared: dict[int, int] = {}
    for name, reservation_id, count in zip(names, values[::2], values[1::2], strict=True):
        if name == session.encode("ascii"):
            if reservation_id in declared:
                raise FrameError(f"declared: reservation {reservation_id} declared twice")
            declared[reservation_id] = count
    return declared

"""Different page sizes: what a gpu_planner decode and prefill add to sglang's ZMQ messages.

sglang refuses a prefill and a decode whose `--page-size` differ. Two
gpu_planner peers serve them (`page_sizes`), and tell each other what they need
in tagged frames that a plain sglang peer never reads:

- `PageSize` (decode -> prefill), appended after the 20 frames of sglang's KV
  registration: the tag, then `<Q` the decode's page size.
- `Repaged` (decode -> prefill), appended after the 10 frames of a request's
  metadata when the prefill's page size is not the decode's: the tag, the
  request's destination pages (int32, in the decode's page size), `<Q` the
  tokens of the prefill's first sent page that the decode already holds (its
  cached prefix, rounded down to the prefill's pages in sglang's
  `decode_prefix_len`, leaves them), then HiSparse's device pages (int32, one
  per destination page; empty: none). sglang's own page frames (4 and 9) go
  empty then, so a plain sglang prefill, which would address them in its own
  page size, writes no KV: the decode fails the request when that prefill's
  Success declares nothing (below).
- `Planned` (prefill -> decode), appended to a prefill rank's Success status:
  the tag, the decode sessions joined by newlines, then one frame per session:
  `<QQ` (the page size the rank planned for, ranges) and `<QQ` (first, end)
  per range: the sent tokens each chunk's descriptors covered, in the order
  the chunks went. A rank that sent that decode no KV declares no range.

Everything parsed here comes from another process: each parser checks frame
counts, lengths and ranges and raises `FrameError` naming the field.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from gpu_planner.integration.sglang.frames import (
    SGLANG_REGISTRATION_FRAMES,
    FrameError,
    pages_to_int32_bytes,
    parse_pages,
)
from gpu_planner.integration.sglang.staging_wire import (
    SGLANG_METADATA_FRAMES,
    SGLANG_STATUS_FRAMES,
    tag_position,
    tagged_frame,
)

PAGE_SIZE_TAG = b"gpu_planner.page_size/1"
REPAGED_TAG = b"gpu_planner.repaged/2"
PLANNED_TAG = b"gpu_planner.planned/1"
MAX_PAGE_SIZE = 1 << 20  # tokens per page: far beyond any KV pool
MAX_TOKENS = 1 << 40  # sent tokens one request's ranges may name
MAX_RANGES = 1 << 20  # chunks one rank may declare for one request
MAX_SESSIONS = 1 << 10  # decode sessions one status may declare toward


def page_size_frames(page_size: int) -> list[bytes]:
    """`PageSize`: the frames a decode appends to its KV registration."""
    return [PAGE_SIZE_TAG, struct.pack("<Q", page_size)]


def registered_page_size(frames: list[bytes]) -> int | None:
    """The page size a decode's registration declares; None for a decode that declares none."""
    frame = tagged_frame(frames, SGLANG_REGISTRATION_FRAMES, PAGE_SIZE_TAG)
    if frame is None:
        return None
    if len(frame) != 8:
        raise FrameError(f"page size: {len(frame)} bytes, expected 8")
    (page_size,) = struct.unpack("<Q", frame)
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise FrameError(f"page size {page_size}: not in 1..{MAX_PAGE_SIZE}")
    return page_size


def repaged_frames(
    pages: np.ndarray, held: int, device_pages: np.ndarray | None = None
) -> list[bytes]:
    """`Repaged`: the frames a decode appends to a request's metadata (its pages, int32, the
    `held` tokens of the prefill's first sent page it already holds, HiSparse's device pages)."""
    if device_pages is not None and len(device_pages) != len(pages):
        raise ValueError(f"{len(device_pages)} device pages for {len(pages)} pages")
    device = b"" if device_pages is None else pages_to_int32_bytes(device_pages, "device pages")
    return [
        REPAGED_TAG,
        pages_to_int32_bytes(pages, "repaged pages"),
        struct.pack("<Q", held),
        device,
    ]


@dataclass(frozen=True)
class Repaged:
    """A request's destination for a prefill of another page size."""

    pages: np.ndarray  # int32: the decode's pages of the sent tokens
    held: int  # tokens of the prefill's first sent page the decode already holds
    device_pages: np.ndarray | None  # int32: HiSparse's device pages of the same tokens


def repaged_request(frames: list[bytes]) -> Repaged | None:
    """What a request's metadata carries for another page size, or None."""
    position = tag_position(frames, SGLANG_METADATA_FRAMES, REPAGED_TAG)
    if position is None:
        return None
    if position + 3 >= len(frames):
        raise FrameError("repaged: the tag must be followed by its pages, held tokens and device")
    held_frame = frames[position + 2]
    if len(held_frame) != 8:
        raise FrameError(f"repaged held tokens: {len(held_frame)} bytes, expected 8")
    (held,) = struct.unpack("<Q", held_frame)
    if held >= MAX_PAGE_SIZE:
        raise FrameError(f"repaged held tokens: {held}, not below {MAX_PAGE_SIZE}")
    pages = parse_pages(frames[position + 1], "repaged pages")
    device_pages = None
    if frames[position + 3]:
        device_pages = parse_pages(frames[position + 3], "repaged device pages")
        if len(device_pages) != len(pages):
            raise FrameError(f"repaged: {len(device_pages)} device pages for {len(pages)} pages")
    return Repaged(pages, int(held), device_pages)


@dataclass(frozen=True)
class Planned:
    """What one prefill rank planned toward one decode session for one request."""

    page_size: int
    ranges: tuple[tuple[int, int], ...]  # (first, end) sent tokens of each chunk, in order

    def frame(self) -> bytes:
        values = [self.page_size, len(self.ranges)]
        values += [value for token_range in self.ranges for value in token_range]
        return struct.pack(f"<{len(values)}Q", *values)

    @classmethod
    def from_frame(cls, frame: bytes) -> Planned:
        if len(frame) < 16 or len(frame) % 16:
            raise FrameError(f"planned: {len(frame)} bytes is not a header and (u64, u64) ranges")
        page_size, count = struct.unpack_from("<QQ", frame)
        if not 1 <= page_size <= MAX_PAGE_SIZE or count > MAX_RANGES:
            raise FrameError(f"planned: page size {page_size}, {count} ranges")
        if len(frame) != 16 * (count + 1):
            raise FrameError(f"planned: {count} ranges in {len(frame) - 16} bytes")
        values = np.frombuffer(frame, dtype="<u8", offset=16).reshape(-1, 2)
        if (values > np.uint64(MAX_TOKENS)).any() or (values[:, 0] >= values[:, 1]).any():
            raise FrameError("planned: a range past 2**40 tokens, or empty")
        return cls(int(page_size), tuple((int(a), int(b)) for a, b in values))


def planned_frames(planned: dict[str, Planned]) -> list[bytes]:
    """`Planned`: frames to append to a Success status, {decode session: what was planned}."""
    sessions = b"\n".join(session.encode("ascii") for session in planned)
    return [PLANNED_TAG, sessions, *(entry.frame() for entry in planned.values())]


def declared_plan(status_frames: list[bytes], session: str) -> Planned | None:
    """What a status declares the rank planned toward decode `session`.

    None for a status without a declaration (a plain sglang prefill), or one
    that declares nothing toward this decode; `FrameError` when malformed.
    """
    position = tag_position(status_frames, SGLANG_STATUS_FRAMES - 1, PLANNED_TAG)
    if position is None:
        return None
    if position + 1 >= len(status_frames):
        raise FrameError("planned: the tag must be followed by its sessions")
    sessions = status_frames[position + 1]
    names = sessions.split(b"\n") if sessions else []
    if len(names) > MAX_SESSIONS or position + 2 + len(names) > len(status_frames):
        raise FrameError(f"planned: {len(names)} sessions without a frame each")
    plans = status_frames[position + 2 : position + 2 + len(names)]
    found = [plan for name, plan in zip(names, plans, strict=True) if name == session.encode()]
    if len(found) > 1:
        raise FrameError(f"planned: session {session} declared twice")
    return Planned.from_frame(found[0]) if found else None

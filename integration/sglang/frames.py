"""ZMQ metadata frames: decode-side ones in sglang 0.5.23's Mooncake layouts, and pull's.

Push (sglang's model): two messages go from decode to prefill, as in sglang's
`MooncakeKVReceiver`:
- `KVRegistration` (once per peer; room frame `b"None"`): the decode KV buffers.
  Frames 0-19 follow `KVArgsRegisterInfo.from_zmq`; then a version frame
  (`REGISTRATION_VERSION`) and what the planner's bounds check and space choice
  need (registered byte lengths, which buffers are device-backed), which
  sglang does not send and ignores.
- `TransferRequest` (per request): the destination pages, frames as
  `TransferInfo.from_zmq` reads them: host pages as int32 bytes in frame 4,
  device pages as int32 bytes in frame 9.

Pull (decode plans and reads): prefill sends decode its own `KVRegistration`
(its source buffers) once, and `SourcePages` per request: pull's own message,
in the same encodings.

Frames come from another process: every parser checks the frame count, each
frame's length and every value's range, and raises `FrameError` (a
`ValueError`) naming the frame and field, never `struct.error` or `IndexError`.
"""

from __future__ import annotations

import contextlib
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from gpu_planner.inputs import INT64_MAX

REGISTRATION_ROOM = b"None"
SGLANG_REGISTRATION_FRAMES = 20  # frames 0-19: what sglang 0.5.23's KVArgsRegisterInfo reads
REGISTRATION_VERSION = b"gpu_planner.registration/1"
REGISTRATION_FRAMES = SGLANG_REGISTRATION_FRAMES + 3  # + version, byte lengths, spaces
TRANSFER_REQUEST_FRAMES = 10  # sglang 0.5.23's build_receiver_metadata_message
_INT32_MAX = np.iinfo(np.int32).max
MAX_PORT = 65535
MAX_RANKS = 2**20  # TP/DCP sizes and ranks: far beyond any deployment, far below absurd


class FrameError(ValueError):
    """A malformed metadata message: names the message, frame and field at fault."""


@contextlib.contextmanager
def _parsing(message: str) -> Iterator[None]:
    """Name `message` in a `FrameError` (or a constructor's `ValueError`) raised parsing it."""
    try:
        yield
    except ValueError as error:
        raise FrameError(f"{message}: {error}") from None


def _pack_u64(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}Q", *values)


def _unpack_u64(frame: bytes, field: str) -> list[int]:
    """Little-endian u64 values, each below 2**63 (a pointer or length of a real buffer)."""
    if len(frame) % 8:
        raise FrameError(f"{field}: {len(frame)} bytes is not a whole number of u64 values")
    values = list(struct.unpack(f"<{len(frame) // 8}Q", frame))
    too_large = [i for i, value in enumerate(values) if value > INT64_MAX]
    if too_large:
        raise FrameError(f"{field}[{too_large[0]}] = {values[too_large[0]]}: must be below 2**63")
    return values


def _text(frame: bytes, field: str) -> str:
    try:
        return frame.decode("ascii")
    except UnicodeDecodeError:
        raise FrameError(f"{field}: not ASCII text: {frame[:40]!r}") from None


def parse_int(frame: bytes, field: str, low: int, high: int) -> int:
    """An ASCII decimal integer frame in [low, high]; `FrameError` naming `field` otherwise."""
    text = _text(frame, field)
    if not re.fullmatch(r"-?[0-9]{1,40}", text):
        raise FrameError(f"{field}: not a decimal integer: {frame[:40]!r}")
    value = int(text)
    if not low <= value <= high:
        raise FrameError(f"{field} = {value}: must be in [{low}, {high}]")
    return value


def _port(frame: bytes, field: str) -> int:
    return parse_int(frame, field, 1, MAX_PORT)


def _ascii(value: int | str) -> bytes:
    return str(value).encode("ascii")


def pages_to_int32_bytes(pages: np.ndarray | torch.Tensor, name: str) -> bytes:
    """Pages as sglang's int32 frame bytes; refuses ids that int32 cannot hold."""
    if isinstance(pages, torch.Tensor):
        pages = pages.cpu().numpy()
    pages = np.asarray(pages)
    if pages.ndim != 1 or (pages.size and pages.dtype.kind not in "iu"):
        raise ValueError(f"{name}: expected a 1-D integer array, got {pages.dtype} {pages.shape}")
    if pages.size and (int(pages.min()) < 0 or int(pages.max()) > _INT32_MAX):
        bad = int(np.flatnonzero((pages < 0) | (pages > _INT32_MAX))[0])
        raise ValueError(f"{name}[{bad}] = {int(pages[bad])}: page ids must fit int32 and be >= 0")
    return pages.astype(np.int32).tobytes()


def parse_pages(frame: bytes, field: str) -> np.ndarray:
    """A writable int32 page array (>= 0) from a frame; `FrameError` naming `field` otherwise.

    Writable: torch refuses read-only NumPy buffers.
    """
    if len(frame) % 4:
        raise FrameError(f"{field}: {len(frame)} bytes is not a whole number of int32 pages")
    pages = np.frombuffer(frame, dtype=np.int32).copy()
    if pages.size and int(pages.min()) < 0:
        bad = int(np.flatnonzero(pages < 0)[0])
        raise FrameError(f"{field}[{bad}] = {int(pages[bad])}: page ids must be >= 0")
    return pages


def _check_count(frames: list[bytes], expected: int, message: str) -> None:
    if not isinstance(frames, list) or not all(isinstance(frame, bytes) for frame in frames):
        raise FrameError(f"not a {message}: expected a list of bytes frames")
    if len(frames) != expected:
        raise FrameError(f"not a {message}: {len(frames)} frames, expected {expected}")


@dataclass(frozen=True)
class KVRegistration:
    """A side's KV buffers, in layout order, and where to reach it.

    The sglang fields (`aux_ptrs`, `tp_rank`, `attn_tp_size`, DCP) default to a
    single-rank worker without auxiliary data; set them to mirror a real one.
    """

    endpoint: str
    port: int
    session_id: str
    ptrs: list[int]
    item_lens: list[int]
    lens: list[int]
    is_device: list[bool]
    aux_ptrs: list[int] = field(default_factory=list)
    tp_rank: int = 0
    attn_tp_size: int = 1
    dcp_size: int = 1
    dcp_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("item_lens", "lens", "is_device"):
            if len(getattr(self, name)) != len(self.ptrs):
                raise ValueError(
                    f"{name}: has {len(getattr(self, name))} entries for {len(self.ptrs)} buffers"
                )

    def to_frames(self) -> list[bytes]:
        """`KVArgsRegisterInfo.from_zmq`'s frames, then the version, byte lengths and spaces."""
        sglang_frames = [
            REGISTRATION_ROOM,
            self.endpoint.encode("ascii"),
            _ascii(self.port),
            self.session_id.encode("ascii"),
            _pack_u64(self.ptrs),
            _pack_u64(self.aux_ptrs),
            b"",  # state buffer pointers (sglang's packing of an empty list)
            _ascii(self.tp_rank),
            _ascii(self.attn_tp_size),
            _ascii(self.item_lens[0] if self.item_lens else 0),
            b"",  # state item lengths
            b"",  # state dims per tensor
            b"",  # kv layer ids
            b"",  # state layer ids
            b"",  # staging base pointer
            b"",  # staging total size
            _ascii(self.dcp_size),
            _ascii(self.dcp_rank),
            b"",  # staging slot layer ids
            _pack_u64(self.item_lens),
        ]
        planner_frames = [
            REGISTRATION_VERSION,
            _pack_u64(self.lens),
            bytes(bool(flag) for flag in self.is_device),
        ]
        return sglang_frames + planner_frames

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> KVRegistration:
        """Parse `to_frames` output; `FrameError` names what is malformed."""
        message = f"{REGISTRATION_VERSION.decode()} KV registration"
        _check_count(frames, REGISTRATION_FRAMES, message)
        version = frames[SGLANG_REGISTRATION_FRAMES]
        if frames[0] != REGISTRATION_ROOM or version != REGISTRATION_VERSION:
            raise FrameError(f"not a {message}: room {frames[0][:40]!r}, version {version[:40]!r}")
        extra = SGLANG_REGISTRATION_FRAMES + 1
        with _parsing(message):  # the constructor checks one entry per buffer in every list
            is_device = frames[extra + 1]
            if set(is_device) - {0, 1}:
                raise FrameError(f"is_device: bytes other than 0 and 1: {is_device[:40]!r}")
            return cls(
                endpoint=_text(frames[1], "endpoint"),
                port=_port(frames[2], "port"),
                session_id=_text(frames[3], "session_id"),
                ptrs=_unpack_u64(frames[4], "ptrs"),
                aux_ptrs=_unpack_u64(frames[5], "aux_ptrs"),
                tp_rank=parse_int(frames[7], "tp_rank", 0, MAX_RANKS - 1),
                attn_tp_size=parse_int(frames[8], "attn_tp_size", 1, MAX_RANKS),
                dcp_size=parse_int(frames[16], "dcp_size", 1, MAX_RANKS),
                dcp_rank=parse_int(frames[17], "dcp_rank", 0, MAX_RANKS - 1),
                item_lens=_unpack_u64(frames[19], "item_lens"),
                lens=_unpack_u64(frames[extra], "lens"),
                is_device=[bool(flag) for flag in is_device],
            )


@dataclass(frozen=True)
class TransferRequest:
    """One request's destination pages in both spaces and where to reach its decode side."""

    room: int
    endpoint: str
    port: int
    session_id: str
    host_pages: np.ndarray
    device_pages: np.ndarray | None = None
    aux_index: int = 0
    required_dst_info_num: int = 1
    decode_prefix_len: int = 0

    def to_frames(self) -> list[bytes]:
        """The ten frames of sglang's `build_receiver_metadata_message` (non-dummy request)."""
        device = self.device_pages
        return [
            _ascii(self.room),
            self.endpoint.encode("ascii"),
            _ascii(self.port),
            self.session_id.encode("ascii"),
            pages_to_int32_bytes(self.host_pages, "host_pages"),
            _ascii(self.aux_index),
            b"",  # state indices: sglang's packing of an empty list of lists
            _ascii(self.required_dst_info_num),
            _ascii(self.decode_prefix_len),
            b"" if device is None else pages_to_int32_bytes(device, "device_pages"),
        ]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> TransferRequest:
        """Parse `to_frames` output; like sglang, an empty frame 9 means no device pages.

        An empty request (no host pages) has empty pages in both spaces, so a
        decode side with device-backed buffers can still be planned (to nothing).
        """
        _check_count(frames, TRANSFER_REQUEST_FRAMES, "transfer request")
        if frames[0] == REGISTRATION_ROOM:
            raise FrameError("not a transfer request: room b'None' (a registration)")
        with _parsing("transfer request"):
            host_pages = parse_pages(frames[4], "host_pages")
            device_pages = None
            if frames[9] or not host_pages.size:
                device_pages = parse_pages(frames[9], "device_pages")
            return cls(
                room=parse_int(frames[0], "room", 0, 2**64 - 1),
                endpoint=_text(frames[1], "endpoint"),
                port=_port(frames[2], "port"),
                session_id=_text(frames[3], "session_id"),
                host_pages=host_pages,
                device_pages=device_pages,
                aux_index=parse_int(frames[5], "aux_index", 0, INT64_MAX),
                required_dst_info_num=parse_int(frames[7], "required_dst_info_num", 1, MAX_RANKS),
                decode_prefix_len=parse_int(frames[8], "decode_prefix_len", 0, INT64_MAX),
            )


@dataclass(frozen=True)
class SourcePages:
    """Pull: one request's prefill-side source pages, sent to the decode side that reads them."""

    room: int
    session_id: str
    pages: np.ndarray

    def to_frames(self) -> list[bytes]:
        return [
            _ascii(self.room),
            self.session_id.encode("ascii"),
            pages_to_int32_bytes(self.pages, "pages"),
        ]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> SourcePages:
        _check_count(frames, 3, "source-pages message")
        with _parsing("source-pages message"):
            return cls(
                room=parse_int(frames[0], "room", 0, 2**64 - 1),
                session_id=_text(frames[1], "session_id"),
                pages=parse_pages(frames[2], "pages"),
            )

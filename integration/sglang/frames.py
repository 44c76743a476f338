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
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import torch

REGISTRATION_ROOM = b"None"
SGLANG_REGISTRATION_FRAMES = 20  # frames 0-19: what sglang 0.5.23's KVArgsRegisterInfo reads
REGISTRATION_VERSION = b"gpu_planner.registration/1"
REGISTRATION_FRAMES = SGLANG_REGISTRATION_FRAMES + 3  # + version, byte lengths, spaces
TRANSFER_REQUEST_FRAMES = 10  # sglang 0.5.23's build_receiver_metadata_message
_INT32_MAX = np.iinfo(np.int32).max


def _pack_u64(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}Q", *values)


def _unpack_u64(frame: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(frame) // 8}Q", frame))


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


def _int32_pages(frame: bytes) -> np.ndarray:
    """A writable int32 page array from a frame (torch refuses read-only NumPy buffers)."""
    return np.frombuffer(frame, dtype=np.int32).copy()


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
        version = (
            frames[SGLANG_REGISTRATION_FRAMES] if len(frames) > SGLANG_REGISTRATION_FRAMES else None
        )
        if (
            len(frames) != REGISTRATION_FRAMES
            or frames[0] != REGISTRATION_ROOM
            or version != REGISTRATION_VERSION
        ):
            raise ValueError(
                f"not a {REGISTRATION_VERSION.decode()} KV registration: {len(frames)} frames "
                f"(expected {REGISTRATION_FRAMES}), room {frames[0] if frames else None!r}, "
                f"version {version!r}"
            )
        extra = SGLANG_REGISTRATION_FRAMES + 1
        return cls(
            endpoint=frames[1].decode("ascii"),
            port=int(frames[2]),
            session_id=frames[3].decode("ascii"),
            ptrs=_unpack_u64(frames[4]),
            aux_ptrs=_unpack_u64(frames[5]),
            tp_rank=int(frames[7]),
            attn_tp_size=int(frames[8]),
            dcp_size=int(frames[16]),
            dcp_rank=int(frames[17]),
            item_lens=_unpack_u64(frames[19]),
            lens=_unpack_u64(frames[extra]),
            is_device=[bool(flag) for flag in frames[extra + 1]],
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
        if len(frames) != TRANSFER_REQUEST_FRAMES or frames[0] == REGISTRATION_ROOM:
            raise ValueError(f"not a transfer request: {len(frames)} frames, room {frames[0]!r}")
        host_pages = _int32_pages(frames[4])
        device_pages = None
        if frames[9] or not host_pages.size:
            device_pages = _int32_pages(frames[9])
        return cls(
            room=int(frames[0]),
            endpoint=frames[1].decode("ascii"),
            port=int(frames[2]),
            session_id=frames[3].decode("ascii"),
            host_pages=host_pages,
            device_pages=device_pages,
            aux_index=int(frames[5]),
            required_dst_info_num=int(frames[7]),
            decode_prefix_len=int(frames[8]),
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
        if len(frames) != 3:
            raise ValueError(f"not a source-pages message: {len(frames)} frames")
        return cls(
            room=int(frames[0]), session_id=frames[1].decode("ascii"), pages=_int32_pages(frames[2])
        )

"""ZMQ metadata frames: decode-side ones in sglang 0.5.23's Mooncake layouts, and pull's.

Push (sglang's model): two messages go from decode to prefill, as in sglang's
`MooncakeKVReceiver`:
- `KVRegistration` (once per peer; room frame `b"None"`): the decode KV buffers.
  Frames 0-19 follow `KVArgsRegisterInfo.from_zmq`; frames 20-21 add what the
  planner's bounds check and space choice need (registered byte lengths and
  which buffers are device-backed), which sglang does not send.
- `TransferRequest` (per request): the destination pages, frames as
  `TransferInfo.from_zmq` reads them: host pages as int32 bytes in frame 4,
  device pages as int32 bytes in frame 9.

Pull (decode plans and reads): prefill sends decode its own `KVRegistration`
(its source buffers) once, and `SourcePages` per request.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from gpu_planner.pending import PendingPageIndices

REGISTRATION_ROOM = b"None"
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
    """The decode side's KV buffers, in layout order, and where to reach it."""

    endpoint: str
    port: int
    session_id: str
    ptrs: list[int]
    item_lens: list[int]
    lens: list[int]
    is_device: list[bool]

    def __post_init__(self) -> None:
        for name in ("item_lens", "lens", "is_device"):
            if len(getattr(self, name)) != len(self.ptrs):
                raise ValueError(
                    f"{name}: has {len(getattr(self, name))} entries for {len(self.ptrs)} buffers"
                )

    def to_frames(self) -> list[bytes]:
        """Frames 0-19 as `KVArgsRegisterInfo.from_zmq` reads them, then lens and spaces."""
        return [
            REGISTRATION_ROOM,
            self.endpoint.encode("ascii"),
            _ascii(self.port),
            self.session_id.encode("ascii"),
            _pack_u64(self.ptrs),
            b"",  # aux buffer pointers: the demo has no aux data
            b"",  # state buffer pointers (sglang's packing of an empty list)
            _ascii(0),  # tp rank
            _ascii(1),  # attention tp size
            _ascii(self.item_lens[0] if self.item_lens else 0),
            b"",  # state item lengths
            b"",  # state dims per tensor
            b"",  # kv layer ids
            b"",  # state layer ids
            b"",  # staging base pointer
            b"",  # staging total size
            _ascii(1),  # dcp size
            _ascii(0),  # dcp rank
            b"",  # staging slot layer ids
            _pack_u64(self.item_lens),
            _pack_u64(self.lens),
            bytes(bool(flag) for flag in self.is_device),
        ]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> KVRegistration:
        if len(frames) != 22 or frames[0] != REGISTRATION_ROOM:
            raise ValueError(
                f"not a gpu_planner KV registration: {len(frames)} frames, room {frames[0]!r}"
            )
        return cls(
            endpoint=frames[1].decode("ascii"),
            port=int(frames[2]),
            session_id=frames[3].decode("ascii"),
            ptrs=_unpack_u64(frames[4]),
            item_lens=_unpack_u64(frames[19]),
            lens=_unpack_u64(frames[20]),
            is_device=[bool(flag) for flag in frames[21]],
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

    @classmethod
    def for_pages(
        cls, pages: PendingPageIndices, *, with_device_pages: bool, **fields
    ) -> TransferRequest:
        """A request for pages still on their way to host memory: waits on their copy alone.

        `with_device_pages` is whether the decode side has device-backed
        buffers (sglang sends frame 9 only then); `fields` are the other fields.
        """
        host = pages.numpy()
        return cls(
            host_pages=host.host, device_pages=host.device if with_device_pages else None, **fields
        )

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
        if len(frames) != 10 or frames[0] == REGISTRATION_ROOM:
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

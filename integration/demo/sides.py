"""The demo's two processes' common parts: registered buffers, ZMQ messages, planning, submitting.

Each side has its own Mooncake engine (TCP, P2P handshake) with its KV
buffers registered and filled with the demo pattern, and a ZMQ inbox. The
decode side owns destination buffers in two page spaces and checks them; the
prefill side owns the source buffers and the request's source pages. Which
side plans and submits is the transfer mode's business (`run.MODES`).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from collections.abc import Callable

import numpy as np
import torch
import zmq

import gpu_planner as gp
from gpu_planner.inputs import INT64_MAX
from gpu_planner.integration.demo.buffers import (
    DECODE_SIDE,
    PREFILL_SIDE,
    KVBuffer,
    Verification,
    verify_buffer,
)
from gpu_planner.integration.demo.config import LOCALHOST, DemoConfig, index_device
from gpu_planner.integration.mooncake import (
    MooncakeTransfer,
    handoff,
    register_buffer,
    session_id,
    start_engine,
)
from gpu_planner.integration.mooncake.engine import (
    engine_process,
    tcp_queue_capacity,
    tcp_queue_env,
)
from gpu_planner.integration.sglang.frames import (
    FrameError,
    KVRegistration,
    SourcePages,
    TransferRequest,
    pages_to_int32_bytes,
    parse_int,
    parse_pages,
)
from gpu_planner.plan import PlanPiece
from gpu_planner.profiling import nvtx_range
from gpu_planner.testing import fragmented_pages

DONE, FAILED, VERIFIED = b"done", b"failed", b"verified"
# Mooncake's largest TCP queue: sglang-sized batches exceed the default one. The demo's
# engines start with it, and its submitters cut calls at it.
ENGINE_ENVIRONMENT = tcp_queue_env()
CALL_LIMIT = tcp_queue_capacity(ENGINE_ENVIRONMENT)
ROOM = 1
_POLL_S = 0.1

PageArray = np.ndarray | torch.Tensor


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The planning side's word to its peer: what was sent (source pages), or why nothing was."""

    room: int
    sent_pages: np.ndarray | None  # None: nothing was sent
    failure: str = ""

    def to_frames(self) -> list[bytes]:
        room = str(self.room).encode()
        if self.sent_pages is None:
            return [FAILED, room, self.failure.encode()]
        return [DONE, room, pages_to_int32_bytes(self.sent_pages, "sent_pages")]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> Outcome:
        """Parse `to_frames` output; `FrameError` for anything else."""
        if len(frames) != 3 or frames[0] not in (DONE, FAILED):
            raise FrameError(f"not a transfer outcome: {len(frames)} frames, {frames[:1]!r}")
        room = parse_int(frames[1], "outcome room", 0, 2**64 - 1)
        if frames[0] == FAILED:
            return cls(room, None, frames[2].decode("utf-8", "replace"))
        return cls(room, parse_pages(frames[2], "outcome sent_pages"))


def parse_verification(frames: list[bytes]) -> Verification:
    """Decode's verification message: `VERIFIED` and one decimal count per field."""
    names = [field.name for field in dataclasses.fields(Verification)]
    if len(frames) != 1 + len(names) or frames[0] != VERIFIED:
        raise FrameError(f"not a verification: {len(frames)} frames, {frames[:1]!r}")
    return Verification(
        *(
            parse_int(frame, f"verification {name}", 0, INT64_MAX)
            for name, frame in zip(names, frames[1:], strict=True)
        )
    )


def _token_slots(pages: np.ndarray, tokens: int, page_size: int) -> torch.Tensor:
    """The token slots of a request holding `pages`, as an allocator's row lists them."""
    slots = pages[:, None] * page_size + np.arange(page_size)[None, :]
    return torch.from_numpy(slots.reshape(-1)[:tokens]).to(index_device())


class Side:
    """What both processes have: an engine, registered pattern-filled buffers, a ZMQ inbox."""

    def __init__(
        self, config: DemoConfig, side: int, pool_pages: list[int], is_device: list[bool]
    ) -> None:
        self.config = config
        self.is_device = is_device
        self.engine = start_engine(LOCALHOST, environment=ENGINE_ENVIRONMENT)
        self.buffers = [
            KVBuffer(side, index, pages, config.item_len) for index, pages in enumerate(pool_pages)
        ]
        for buffer in self.buffers:
            register_buffer(self.engine, buffer.ptr, buffer.nbytes)
        self.session_id = session_id(self.engine, LOCALHOST)
        self.zmq = zmq.Context()
        self.inbox = self.zmq.socket(zmq.PULL)
        self.port = self.inbox.bind_to_random_port(f"tcp://{LOCALHOST}")
        self.peer_process: multiprocessing.Process | None = None

    def registration(self) -> KVRegistration:
        """This side's buffers, in layout order, and where to reach it."""
        return KVRegistration(
            endpoint=LOCALHOST,
            port=self.port,
            session_id=self.session_id,
            ptrs=[buffer.ptr for buffer in self.buffers],
            item_lens=[buffer.item_len for buffer in self.buffers],
            lens=[buffer.nbytes for buffer in self.buffers],
            is_device=self.is_device,
        )

    def start_peer(self, target: Callable[[DemoConfig, int], None]) -> multiprocessing.Process:
        """Start the other side's process (`engine_process`: no state inherited from this one)."""
        process = engine_process(target, (self.config, self.port))
        process.start()
        self.peer_process = process
        return process

    def outbox(self, endpoint: str, port: int) -> zmq.Socket:
        socket = self.zmq.socket(zmq.PUSH)
        socket.connect(f"tcp://{endpoint}:{port}")
        return socket

    def receive(self, waiting_for: str) -> list[bytes]:
        """The next message, within `timeout_s`; fails early when the peer process has exited."""
        deadline = time.monotonic() + self.config.timeout_s
        while not self.inbox.poll(int(_POLL_S * 1000)):
            peer = self.peer_process
            if peer is not None and not peer.is_alive():
                raise RuntimeError(f"peer process exited ({peer.exitcode}) before {waiting_for}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {waiting_for} within {self.config.timeout_s} s")
        return self.inbox.recv_multipart()

    def close(self) -> None:
        self.zmq.destroy(linger=0)
        for buffer in self.buffers:
            self.engine.unregister_memory(buffer.ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class DecodeSide(Side):
    """The decode process: destination buffers in two page spaces, their pages, the checker."""

    def __init__(self, config: DemoConfig) -> None:
        pools = {False: config.pool_pages(config.host_pool_factor)}
        pools[True] = config.pool_pages(config.device_pool_factor)
        is_device = config.is_device
        super().__init__(config, DECODE_SIDE, [pools[flag] for flag in is_device], is_device)
        rng = np.random.default_rng([config.seed, DECODE_SIDE])
        host = fragmented_pages(config.num_pages, config.mean_run, rng, pool_pages=pools[False])
        device = fragmented_pages(config.num_pages, config.mean_run, rng, pool_pages=pools[True])
        self.pages = gp.page_indices_async(
            _token_slots(device, config.tokens, config.page_size),
            _token_slots(host, config.tokens, config.page_size),
            0,
            config.tokens,
            config.page_size,
        )

    @property
    def has_device_buffers(self) -> bool:
        return any(self.is_device)

    def transfer_request(self) -> TransferRequest:
        """The request's pages in sglang's frame layout (waits on their host copy alone)."""
        host_pages = self.pages.numpy()  # waits on the pages' host copy alone
        return TransferRequest(
            host_pages=host_pages.host,
            device_pages=host_pages.device if self.has_device_buffers else None,
            room=ROOM,
            endpoint=LOCALHOST,
            port=self.port,
            session_id=self.session_id,
        )

    def verify(self, src_pages: np.ndarray) -> Verification:
        """Check every byte of every buffer; with no source pages, that nothing changed."""
        pages = self.pages.numpy()
        total = Verification(0, 0, 0, 0)
        with nvtx_range("demo/verify"):
            for buffer, device_space in zip(self.buffers, self.is_device, strict=True):
                dst_pages = (pages.device if device_space else pages.host)[: src_pages.size]
                total += verify_buffer(buffer, dst_pages, src_pages)
        return total

    def serve_push(self, prefill_port: int) -> None:
        """Push peer: announce the buffers and pages, wait for the outcome, verify, report."""
        to_prefill = self.outbox(LOCALHOST, prefill_port)
        to_prefill.send_multipart(self.registration().to_frames())
        to_prefill.send_multipart(self.transfer_request().to_frames())
        outcome = Outcome.from_frames(self.receive("the transfer outcome from prefill"))
        sent = outcome.sent_pages
        verification = dataclasses.astuple(self.verify(np.empty(0) if sent is None else sent))
        fields = (str(value).encode() for value in verification)
        to_prefill.send_multipart([VERIFIED, *fields])

    def receive_source(self) -> tuple[KVRegistration, list[bytes]]:
        """Pull: the prefill side's registration (where to report), then the source pages' frames.

        A malformed registration raises `FrameError`: the prefill side cannot
        be told, and times out. The caller parses the pages, so it can report
        a malformed message to the prefill side.
        """
        registration = KVRegistration.from_frames(self.receive("the prefill registration"))
        return registration, self.receive("the source pages")


class PrefillSide(Side):
    """The prefill process: pattern-filled source buffers and the request's source pages."""

    def __init__(self, config: DemoConfig) -> None:
        pool_pages = config.pool_pages(config.host_pool_factor)
        buffers = config.buffers
        super().__init__(config, PREFILL_SIDE, [pool_pages] * buffers, [False] * buffers)
        rng = np.random.default_rng([config.seed, PREFILL_SIDE])
        self.src_pages = fragmented_pages(
            config.num_pages, config.mean_run, rng, pool_pages=pool_pages
        )

    def receive_metadata(self) -> tuple[list[bytes], TransferRequest]:
        """Push: the decode side's registration frames, then its transfer request.

        A malformed request raises `FrameError`: it says where decode listens,
        so decode cannot be told, and times out. The caller parses the
        registration, so it can report a malformed one to decode.
        """
        registration_frames = self.receive("the decode registration")
        return registration_frames, TransferRequest.from_frames(
            self.receive("the transfer request")
        )

    def finish(self, request: TransferRequest, failure: str | None = None) -> Verification:
        """Push: tell decode what was sent (or why nothing was); return its verification."""
        to_decode = self.outbox(request.endpoint, request.port)
        sent = self.src_pages if failure is None else None
        to_decode.send_multipart(Outcome(request.room, sent, failure or "").to_frames())
        return parse_verification(self.receive("the verification from decode"))

    def serve_pull(self, decode_port: int) -> None:
        """Pull peer: send the buffers and source pages, keep them until decode has read."""
        to_decode = self.outbox(LOCALHOST, decode_port)
        to_decode.send_multipart(self.registration().to_frames())
        source = SourcePages(room=ROOM, session_id=self.session_id, pages=self.src_pages)
        to_decode.send_multipart(source.to_frames())
        # Decode has read (or failed; it reports that itself): a malformed word is a FrameError.
        Outcome.from_frames(self.receive("the transfer outcome from decode"))


def pair_layout(source: KVRegistration, destination: KVRegistration) -> gp.BufferLayout:
    """Buffer pairs in layout order, bounded by both sides' registered lengths.

    The same layout whichever side builds it: push builds it on prefill from
    decode's registration, pull on decode from prefill's.
    """
    layout = gp.BufferLayout(
        src_ptrs=source.ptrs,
        dst_ptrs=destination.ptrs,
        item_lens=source.item_lens,
        dst_is_device=destination.is_device,
        src_lens=source.lens,
        dst_lens=destination.lens,
    )
    # The layout has checked that both sides have as many buffers.
    mismatched = np.flatnonzero(np.array(source.item_lens) != np.array(destination.item_lens))
    if mismatched.size:
        buffer = int(mismatched[0])
        raise gp.PlanValidationError(
            f"item_lens: buffer {buffer} has {source.item_lens[buffer]} bytes per page on the "
            f"source side but {destination.item_lens[buffer]} on the destination side"
        )
    return layout


@dataclasses.dataclass
class Planned:
    """A planned request: engine-ready work (in `handoff`'s form), its size, its planning time."""

    work: list[PlanPiece]
    handoff: handoff.HandoffForm
    descriptors: int
    total_bytes: int
    plan_s: float


def _host_pages(pages: PageArray | None) -> np.ndarray | None:
    return pages.cpu().numpy() if isinstance(pages, torch.Tensor) else pages


def _index_pages(pages: PageArray | None) -> torch.Tensor | None:
    return None if pages is None else torch.as_tensor(pages, device=index_device())


def _gpu_planner_work(
    config: DemoConfig,
    layout: gp.BufferLayout,
    engine_handoff: handoff.Handoff,
    src,
    dst,
    dst_device,
) -> list[PlanPiece]:
    src, dst, dst_device = (_index_pages(pages) for pages in (src, dst, dst_device))
    plan = gp.plan_transfer(src, dst, layout, dst_device, max_batch_pages=config.max_batch_pages)
    return list(engine_handoff.pieces(plan, per_buffer=bool(config.buffer_workers)))


def _reference_work(
    config: DemoConfig,
    layout: gp.BufferLayout,
    engine_handoff: handoff.Handoff,
    src,
    dst,
    dst_device,
) -> list[PlanPiece]:
    batches = gp.reference.plan_batches(
        _host_pages(src),
        _host_pages(dst),
        layout.src_ptrs.tolist(),
        layout.dst_ptrs.tolist(),
        layout.item_lens.tolist(),
        dst_is_device=layout.dst_is_device.tolist(),
        dst_device_pages=_host_pages(dst_device),
        max_batch_pages=config.max_batch_pages,
    )
    return [PlanPiece(batch, None, *descriptors) for batch, descriptors in enumerate(batches)]


def plan_request(
    config: DemoConfig,
    layout: gp.BufferLayout,
    src_pages: PageArray,
    dst_pages: PageArray,
    dst_device_pages: PageArray | None,
    engine_handoff: handoff.Handoff,
) -> Planned:
    """Plan with the configured planner, up to what the engine takes (timed, warm).

    gpu_planner's work takes the engine's hand-off form (descriptor arrays for
    a Mooncake that takes them); the reference loop builds lists.
    """
    plan_work = _gpu_planner_work if config.planner == "gpu" else _reference_work
    form = engine_handoff.form if config.planner == "gpu" else handoff.LISTS
    inputs = (engine_handoff, src_pages, dst_pages, dst_device_pages)
    plan_work(config, layout, *inputs)  # warm-up: JIT compilation is not a per-request cost
    start = time.perf_counter()
    with nvtx_range("demo/plan"):
        work = plan_work(config, layout, *inputs)
    plan_s = time.perf_counter() - start
    lens = [item[-1] for item in work]
    total_bytes = sum(map(handoff.column_total, lens))
    return Planned(work, form, sum(map(len, lens)), total_bytes, plan_s)


def submit(
    config: DemoConfig, transfer: type[MooncakeTransfer], engine, peer: str, planned: Planned
) -> float:
    """Submit the planned work to `peer` (MooncakeSender or MooncakeReader); seconds taken.

    Uses the configured buffer workers and `timeout_s` per batch; raises `TransferError`.
    """
    with transfer(
        engine,
        peer,
        buffer_workers=config.buffer_workers,
        batch_timeout_s=config.timeout_s,
        max_call_descriptors=CALL_LIMIT,
        handoff_form=planned.handoff,
    ) as submitter:
        start = time.perf_counter()
        submitter.submit_pieces(planned.work)
        return time.perf_counter() - start


def count_runs(
    config: DemoConfig, src: np.ndarray, dst: np.ndarray, dst_device: np.ndarray | None
) -> tuple[int, int]:
    """Runs in the host and the device destination space (0 device runs without device pages)."""
    runs = gp.group_runs(src, dst, dst_device, config.max_batch_pages)
    return len(runs.host), 0 if runs.device is None else len(runs.device)

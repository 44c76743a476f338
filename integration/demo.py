"""Two-process PD demo: a prefill process writes one request's KV into a decode process.

Both processes run on 127.0.0.1, each with its own Mooncake engine (TCP, P2P
handshake), and talk over ZMQ as sglang's Mooncake connector does:

1. decode registers its buffers (host-backed and device-backed), allocates the
   request's pages from two independent fragmented allocators, converts token
   slots to pages with `gp.page_indices`, and pushes a `KVRegistration` and a
   `TransferRequest` (sglang's frame layouts) to prefill;
2. prefill plans (gpu_planner, or the sglang-style reference loop) with the
   registered lengths as bounds, submits with `MooncakeSender`, and tells
   decode which source pages it sent (or why it sent nothing);
3. decode verifies every byte of every buffer and reports back.

Who plans and submits is a `TransferMode` in `MODES`: `push` is sglang's model
(prefill plans and writes); a `pull` mode (decode plans and reads) is another
entry with its own prefill step and decode process.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq
from gpu_planner.integration.demo_buffers import (
    DECODE_SIDE,
    PREFILL_SIDE,
    WORD_BYTES,
    KVBuffer,
    Verification,
    fragmented_pages,
    verify_buffer,
)
from gpu_planner.integration.frames import KVRegistration, TransferRequest, pages_to_int32_bytes
from gpu_planner.integration.mooncake import (
    LOCALHOST,
    MooncakeSender,
    nvtx_range,
    register_buffer,
    session_id,
    start_engine,
)

import gpu_planner as gp

PLANNERS = ("gpu", "reference")
DONE, FAILED, VERIFIED = b"done", b"failed", b"verified"
ROOM = 1
_POLL_S = 0.1


@dataclass(frozen=True)
class DemoConfig:
    """Every knob of the demo; the defaults move about 120 MiB in one request."""

    buffers: int = 61
    device_fraction: float = 0.5
    tokens: int = 32768
    page_size: int = 64
    item_len: int = 4096
    mean_run: float = 8.0
    max_batch_pages: int = 1024
    host_pool_factor: float = 2.0
    device_pool_factor: float = 1.5
    planner: str = "gpu"
    mode: str = "push"
    buffer_workers: int = 0
    seed: int = 0
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("buffers", "page_size", "item_len", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("tokens", "max_batch_pages", "buffer_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.item_len % WORD_BYTES:
            raise ValueError(f"item_len: must be a multiple of {WORD_BYTES}, got {self.item_len}")
        if not 0.0 <= self.device_fraction <= 1.0:
            raise ValueError(f"device_fraction: must be in [0, 1], got {self.device_fraction}")
        for name in ("host_pool_factor", "device_pool_factor", "mean_run"):
            if getattr(self, name) < 1.0:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.planner not in PLANNERS:
            raise ValueError(f"planner: must be one of {PLANNERS}, got {self.planner!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode: must be one of {tuple(MODES)}, got {self.mode!r}")
        if self.buffer_workers and self.planner != "gpu":
            raise ValueError("buffer_workers: per-buffer submission needs planner 'gpu'")

    @property
    def num_pages(self) -> int:
        return math.ceil(self.tokens / self.page_size)

    def pool_pages(self, factor: float) -> int:
        """Pages of a pool holding `factor` times the request (at least one page)."""
        return max(1, math.ceil(self.num_pages * factor))

    @property
    def is_device(self) -> list[bool]:
        """Which buffers are device-backed: `device_fraction` of them, spread evenly."""
        fraction = self.device_fraction
        return [
            math.floor((b + 1) * fraction) > math.floor(b * fraction) for b in range(self.buffers)
        ]


def index_device() -> torch.device:
    """Where page indices live: the GPU when there is one (Triton path), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _token_slots(pages: np.ndarray, tokens: int, page_size: int) -> torch.Tensor:
    """The token slots of a request holding `pages`, as an allocator's row lists them."""
    slots = pages[:, None] * page_size + np.arange(page_size)[None, :]
    return torch.from_numpy(slots.reshape(-1)[:tokens]).to(index_device())


class _Side:
    """What both processes have: an engine, registered pattern-filled buffers, a ZMQ inbox."""

    def __init__(self, config: DemoConfig, side: int, pool_pages: list[int]) -> None:
        self.config = config
        self.engine = start_engine()
        self.buffers = [
            KVBuffer(side, index, pages, config.item_len) for index, pages in enumerate(pool_pages)
        ]
        for buffer in self.buffers:
            register_buffer(self.engine, buffer.ptr, buffer.nbytes)
        self.session_id = session_id(self.engine)
        self.zmq = zmq.Context()
        self.inbox = self.zmq.socket(zmq.PULL)
        self.port = self.inbox.bind_to_random_port(f"tcp://{LOCALHOST}")
        self.peer_process: multiprocessing.Process | None = None

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


class DecodeSide(_Side):
    """The decode process: destination buffers in two page spaces, and the checker."""

    def __init__(self, config: DemoConfig, prefill_port: int) -> None:
        pools = {False: config.pool_pages(config.host_pool_factor)}
        pools[True] = config.pool_pages(config.device_pool_factor)
        super().__init__(config, DECODE_SIDE, [pools[flag] for flag in config.is_device])
        self.to_prefill = self.outbox(LOCALHOST, prefill_port)
        rng = np.random.default_rng([config.seed, DECODE_SIDE])
        host = fragmented_pages(pools[False], config.num_pages, config.mean_run, rng)
        device = fragmented_pages(pools[True], config.num_pages, config.mean_run, rng)
        self.pages = gp.page_indices(
            _token_slots(device, config.tokens, config.page_size),
            _token_slots(host, config.tokens, config.page_size),
            0,
            config.tokens,
            config.page_size,
        )

    def announce(self) -> None:
        """Push the buffer registration and the request's pages to prefill."""
        is_device = self.config.is_device
        registration = KVRegistration(
            endpoint=LOCALHOST,
            port=self.port,
            session_id=self.session_id,
            ptrs=[buffer.ptr for buffer in self.buffers],
            item_lens=[buffer.item_len for buffer in self.buffers],
            lens=[buffer.nbytes for buffer in self.buffers],
            is_device=is_device,
        )
        request = TransferRequest(
            room=ROOM,
            endpoint=LOCALHOST,
            port=self.port,
            session_id=self.session_id,
            host_pages=self.pages.host,
            device_pages=self.pages.device if any(is_device) else None,
        )
        self.to_prefill.send_multipart(registration.to_frames())
        self.to_prefill.send_multipart(request.to_frames())

    def verify(self, src_pages: np.ndarray) -> Verification:
        """Check every byte of every buffer; with no source pages, that nothing changed."""
        pages = {False: self.pages.host, True: self.pages.device}
        total = Verification(0, 0, 0, 0)
        with nvtx_range("gpu_planner.demo.verify"):
            for buffer, on_device in zip(self.buffers, self.config.is_device, strict=True):
                dst_pages = pages[on_device].cpu().numpy() if src_pages.size else src_pages
                total += verify_buffer(buffer, dst_pages, src_pages)
        return total

    def serve(self) -> None:
        """Announce, wait for prefill's outcome, verify, and report the verification."""
        self.announce()
        frames = self.receive("the transfer outcome from prefill")
        sent = frames[0] == DONE
        src_pages = np.frombuffer(frames[2], dtype=np.int32) if sent else np.empty(0, np.int64)
        verification = self.verify(src_pages)
        fields = (str(value).encode() for value in dataclasses.astuple(verification))
        self.to_prefill.send_multipart([VERIFIED, *fields])


def run_push_decode(config: DemoConfig, prefill_port: int) -> None:
    """Entry point of the decode process in push mode."""
    with DecodeSide(config, prefill_port) as decode:
        decode.serve()


@dataclass
class Planned:
    """A planned request: engine-ready work, its size, and how long planning took."""

    work: list
    descriptors: int
    total_bytes: int
    plan_s: float


def _gpu_planner_work(config: DemoConfig, layout: gp.BufferLayout, src, dst, dst_device) -> list:
    plan = gp.plan_transfer(src, dst, layout, dst_device, max_batch_pages=config.max_batch_pages)
    return list(plan.buffer_batches() if config.buffer_workers else plan.batches())


def _reference_work(config: DemoConfig, layout: gp.BufferLayout, src, dst, dst_device) -> list:
    return gp.reference.plan_batches(
        src,
        dst,
        layout.src_ptrs.tolist(),
        layout.dst_ptrs.tolist(),
        layout.item_lens.tolist(),
        dst_is_device=layout.dst_is_device.tolist(),
        dst_device_pages=dst_device,
        max_batch_pages=config.max_batch_pages,
    )


class PrefillSide(_Side):
    """The prefill process: pattern-filled source buffers, the planner and the sender."""

    def __init__(self, config: DemoConfig) -> None:
        pool_pages = config.pool_pages(config.host_pool_factor)
        super().__init__(config, PREFILL_SIDE, [pool_pages] * config.buffers)
        rng = np.random.default_rng([config.seed, PREFILL_SIDE])
        self.src_pages = fragmented_pages(pool_pages, config.num_pages, config.mean_run, rng)

    def spawn_decode(self, target: Callable[[DemoConfig, int], None]) -> multiprocessing.Process:
        """Start the decode process (spawned: no state inherited from this one)."""
        process = multiprocessing.get_context("spawn").Process(
            target=target, args=(self.config, self.port), daemon=True
        )
        process.start()
        self.peer_process = process
        return process

    def receive_metadata(self) -> tuple[KVRegistration, TransferRequest]:
        registration = KVRegistration.from_frames(self.receive("the decode registration"))
        request = TransferRequest.from_frames(self.receive("the transfer request"))
        return registration, request

    def layout(self, registration: KVRegistration) -> gp.BufferLayout:
        """Buffer pairs in layout order, bounded by both sides' registered lengths."""
        return gp.BufferLayout(
            src_ptrs=[buffer.ptr for buffer in self.buffers],
            dst_ptrs=registration.ptrs,
            item_lens=[buffer.item_len for buffer in self.buffers],
            dst_is_device=registration.is_device,
            src_lens=[buffer.nbytes for buffer in self.buffers],
            dst_lens=registration.lens,
        )

    def plan(
        self, layout: gp.BufferLayout, dst_pages: np.ndarray, dst_device_pages: np.ndarray | None
    ) -> Planned:
        """Plan with the configured planner, up to the engine's Python lists (timed, warm)."""
        config = self.config
        inputs = (self.src_pages, dst_pages, dst_device_pages)
        plan_work = _reference_work
        if config.planner == "gpu":
            plan_work = _gpu_planner_work
            inputs = tuple(
                None if pages is None else torch.from_numpy(np.array(pages)).to(index_device())
                for pages in inputs
            )
        plan_work(config, layout, *inputs)  # warm-up: JIT compilation is not a per-request cost
        start = time.perf_counter()
        with nvtx_range("gpu_planner.demo.plan"):
            work = plan_work(config, layout, *inputs)
        plan_s = time.perf_counter() - start
        lens = [item[-1] for item in work]
        return Planned(work, sum(map(len, lens)), sum(map(sum, lens)), plan_s)

    def sender(self, peer: str, engine=None) -> MooncakeSender:
        """A sender to `peer` with the configured buffer workers and per-batch time bound."""
        config = self.config
        return MooncakeSender(
            self.engine if engine is None else engine,
            peer,
            buffer_workers=config.buffer_workers,
            batch_timeout_s=config.timeout_s,
        )

    def send(self, sender: MooncakeSender, planned: Planned) -> float:
        """Submit the planned work; seconds taken. Raises `TransferError`."""
        start = time.perf_counter()
        if self.config.buffer_workers:
            sender.send_buffer_batches(planned.work)
        else:
            sender.send_batches(planned.work)
        return time.perf_counter() - start

    def finish(self, request: TransferRequest, failure: str | None = None) -> Verification:
        """Tell decode what was sent (or why nothing was) and return its verification."""
        to_decode = self.outbox(request.endpoint, request.port)
        room = str(request.room).encode()
        if failure is None:
            to_decode.send_multipart([DONE, room, pages_to_int32_bytes(self.src_pages, "src")])
        else:
            to_decode.send_multipart([FAILED, room, failure.encode()])
        frames = self.receive("the verification from decode")
        return Verification(*(int(value) for value in frames[1:]))


@dataclass
class DemoReport:
    """What one demo run measured and found."""

    config: DemoConfig
    pages: int = 0
    host_runs: int = 0
    device_runs: int = 0
    descriptors: int = 0
    total_bytes: int = 0
    plan_s: float = 0.0
    submit_s: float = 0.0
    verification: Verification | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and self.verification is not None and self.verification.ok


def _count_runs(config: DemoConfig, src: np.ndarray, request: TransferRequest) -> tuple[int, int]:
    device_pages = request.device_pages if any(config.is_device) else None
    runs = gp.group_runs(src, request.host_pages, device_pages, config.max_batch_pages)
    return len(runs.host), 0 if runs.device is None else len(runs.device)


def run_push_prefill(prefill: PrefillSide, report: DemoReport) -> None:
    """sglang's model: decode sends its pages; prefill plans, writes and reports the outcome."""
    registration, request = prefill.receive_metadata()
    report.pages = len(request.host_pages)
    report.host_runs, report.device_runs = _count_runs(prefill.config, prefill.src_pages, request)
    failure = None
    try:
        layout = prefill.layout(registration)
        planned = prefill.plan(layout, request.host_pages, request.device_pages)
        report.descriptors, report.total_bytes = planned.descriptors, planned.total_bytes
        report.plan_s = planned.plan_s
        with prefill.sender(request.session_id) as sender:
            report.submit_s = prefill.send(sender, planned)
    except (gp.PlanValidationError, RuntimeError) as error:
        failure = f"{type(error).__name__}: {error}"
        report.errors.append(failure)
    report.verification = prefill.finish(request, failure)


@dataclass(frozen=True)
class TransferMode:
    """Who plans and submits: the prefill-process step and the decode process's entry point."""

    prefill: Callable[[PrefillSide, DemoReport], None]
    decode: Callable[[DemoConfig, int], None]


MODES: dict[str, TransferMode] = {"push": TransferMode(run_push_prefill, run_push_decode)}


def run_demo(config: DemoConfig) -> DemoReport:
    """Run one request through two processes; return what was measured and verified."""
    report = DemoReport(config)
    mode = MODES[config.mode]
    with PrefillSide(config) as prefill:
        decode = prefill.spawn_decode(mode.decode)
        try:
            mode.prefill(prefill, report)
        except (RuntimeError, TimeoutError) as error:
            report.errors.append(f"{type(error).__name__}: {error}")
        finally:
            decode.join(config.timeout_s)
            if decode.is_alive():
                decode.kill()
                decode.join()
    if decode.exitcode != 0:
        report.errors.append(f"decode process exited with code {decode.exitcode}")
    return report


def format_report(report: DemoReport) -> str:
    """The demo's result table."""
    config = report.config
    planner = f"gpu_planner ({index_device().type})" if config.planner == "gpu" else "reference"
    rate = report.total_bytes / report.submit_s / 1e9 if report.submit_s else 0.0
    check = report.verification
    verdict = "not run"
    if check is not None:
        verdict = (
            f"{'OK' if check.ok else 'MISMATCH'}: {check.bytes_checked} bytes of "
            f"{check.pages_checked} pages checked; {check.bad_pages} planned pages wrong, "
            f"{check.changed_pages} other pages changed"
        )
    rows = [
        ("mode / planner", f"{config.mode} / {planner}"),
        ("buffers", f"{config.buffers} ({sum(config.is_device)} device-backed)"),
        ("pages", f"{report.pages} ({config.tokens} tokens, page size {config.page_size})"),
        ("runs host / device", f"{report.host_runs} / {report.device_runs}"),
        ("descriptors", f"{report.descriptors} (max {config.max_batch_pages} pages per batch)"),
        ("plan time", f"{report.plan_s * 1e3:.2f} ms"),
        ("submit time", f"{report.submit_s * 1e3:.2f} ms"),
        ("bytes", f"{report.total_bytes} ({report.total_bytes / 2**20:.1f} MiB)"),
        ("throughput", f"{rate:.3f} GB/s"),
        ("verification", verdict),
    ]
    rows += [("error", error) for error in report.errors]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)

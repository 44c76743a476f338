"""Two-process PD demo: one request's KV moves between a prefill and a decode process.

Both processes run on 127.0.0.1, each with its own Mooncake engine (TCP, P2P
handshake), and talk over ZMQ. The demo's own process is the side that plans
and submits; it starts the other side. Two transfer modes (`MODES`):

- push (sglang's model; the default): decode registers its buffers (host- and
  device-backed), allocates the request's pages from two independent
  fragmented allocators, converts token slots to pages with
  `gp.page_indices_async`, and sends a `KVRegistration` and a `TransferRequest`
  (sglang's frame layouts) to prefill; prefill plans with the registered
  lengths as bounds, writes with `MooncakeSender`, and tells decode which
  source pages it sent; decode verifies every byte and reports back.
- pull (decode plans and reads, as vLLM's NIXL connector does): prefill sends
  decode its `KVRegistration` and the request's `SourcePages`; decode plans on
  its own device against its own pages, reads with `MooncakeReader`, verifies
  every byte, and tells prefill it is done.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import gpu_planner as gp
from gpu_planner.integration.demo.buffers import Verification
from gpu_planner.integration.demo.config import DemoConfig, index_device
from gpu_planner.integration.demo.sides import (
    ROOM,
    DecodeSide,
    Outcome,
    PrefillSide,
    Side,
    count_runs,
    pair_layout,
    plan_request,
    submit,
)
from gpu_planner.integration.mooncake import (
    MooncakeReader,
    MooncakeSender,
    MooncakeTransfer,
    handoff,
)
from gpu_planner.integration.sglang.frames import KVRegistration, SourcePages

PEER_EXIT_S = 10.0  # past timeout_s: a peer's own time-out and engine shutdown, then SIGKILL


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
    handoff: str = "-"
    verification: Verification | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and self.verification is not None and self.verification.ok


def _failure(error: Exception, report: DemoReport) -> str:
    failure = f"{type(error).__name__}: {error}"
    report.errors.append(failure)
    return failure


def _plan_and_submit(
    report: DemoReport,
    side: Side,
    transfer: type[MooncakeTransfer],
    peer_session_id: str,
    layout: gp.BufferLayout,
    src_pages: np.ndarray,
    dst_pages: gp.PageIndices,
    dst_pages_in_host_memory: gp.PageIndices,
) -> None:
    """Count runs, plan `dst_pages` (device space None without device buffers), submit."""
    config = side.config
    report.host_runs, report.device_runs = count_runs(config, src_pages, *dst_pages_in_host_memory)
    planned = plan_request(
        config, layout, src_pages, *dst_pages, handoff.Handoff.of(side.engine, transfer.direction)
    )
    report.descriptors, report.total_bytes = planned.descriptors, planned.total_bytes
    report.handoff = planned.handoff
    report.plan_s = planned.plan_s
    report.submit_s = submit(config, transfer, side.engine, peer_session_id, planned)


def run_push(prefill: PrefillSide, report: DemoReport) -> None:
    """sglang's model, in the prefill process: plan, write, and collect decode's verification."""
    registration_frames, request = prefill.receive_metadata()
    report.pages = len(request.host_pages)
    failure = None
    try:
        registration = KVRegistration.from_frames(registration_frames)
        dst_pages = gp.PageIndices(request.host_pages, request.device_pages)
        layout = pair_layout(prefill.registration(), registration)
        _plan_and_submit(
            report, prefill, MooncakeSender, request.session_id, layout,
            prefill.src_pages, dst_pages, dst_pages,
        )  # fmt: skip
    except Exception as error:  # whatever failed, decode hears of it and ends
        failure = _failure(error, report)
    report.verification = prefill.finish(request, failure)


def _peer_process(name: str, serve: Callable[[], None]) -> None:
    """Run a peer process's side; any failure ends it with one line on stderr and exit code 1.

    The demo's own process reports the run; the peer's traceback would only
    bury the reason (a malformed message, a timeout) in noise.
    """
    try:
        serve()
    except Exception as error:
        print(
            f"gpu-planner demo ({name} process): {type(error).__name__}: {error}", file=sys.stderr
        )
        raise SystemExit(1) from None


def run_push_decode(config: DemoConfig, prefill_port: int) -> None:
    """Entry point of the decode process in push mode."""

    def serve() -> None:
        with DecodeSide(config) as decode:
            decode.serve_push(prefill_port)

    _peer_process("decode", serve)


def run_pull(decode: DecodeSide, report: DemoReport) -> None:
    """The pull model, in the decode process: plan on its own device, read, verify."""
    registration, source_frames = decode.receive_source()
    source = SourcePages(ROOM, registration.session_id, np.empty(0, np.int32))
    failure = None
    try:
        source = SourcePages.from_frames(source_frames)
        report.pages = len(source.pages)
        computed, copies = decode.pages.computed, decode.pages.numpy()
        if not decode.has_device_buffers:
            computed, copies = computed._replace(device=None), copies._replace(device=None)
        layout = pair_layout(registration, decode.registration())
        _plan_and_submit(
            report, decode, MooncakeReader, registration.session_id, layout,
            source.pages, computed, copies,
        )  # fmt: skip
    except Exception as error:  # whatever failed, prefill hears of it and ends
        failure = _failure(error, report)
    sent = source.pages if failure is None else None
    report.verification = decode.verify(np.empty(0, np.int64) if sent is None else sent)
    to_prefill = decode.outbox(registration.endpoint, registration.port)
    to_prefill.send_multipart(Outcome(source.room, sent, failure or "").to_frames())


def run_pull_prefill(config: DemoConfig, decode_port: int) -> None:
    """Entry point of the prefill process in pull mode."""

    def serve() -> None:
        with PrefillSide(config) as prefill:
            prefill.serve_pull(decode_port)

    _peer_process("prefill", serve)


@dataclass(frozen=True)
class TransferMode:
    """Who plans and submits (this process's side and step) and the peer process's entry point."""

    initiator: Callable[[DemoConfig], Side]
    run: Callable[[Side, DemoReport], None]
    peer: Callable[[DemoConfig, int], None]


MODES: dict[str, TransferMode] = {
    "push": TransferMode(PrefillSide, run_push, run_push_decode),
    "pull": TransferMode(DecodeSide, run_pull, run_pull_prefill),
}


def run_demo(config: DemoConfig) -> DemoReport:
    """Run one request through two processes; return what was measured and verified."""
    report = DemoReport(config)
    mode = MODES[config.mode]
    with mode.initiator(config) as side:
        peer = side.start_peer(mode.peer)
        try:
            mode.run(side, report)
        except Exception as error:  # reported; the peer is joined (or killed) below
            _failure(error, report)
        finally:
            # The peer's own waits end at timeout_s: let it time out and shut its engine down.
            peer.join(config.timeout_s + PEER_EXIT_S)
            if peer.is_alive():
                peer.kill()
                peer.join()
    if peer.exitcode != 0:
        report.errors.append(f"peer process exited with code {peer.exitcode}")
    return report


def _mooncake_version() -> str:
    from gpu_planner.integration.info import mooncake_distributions

    return ", ".join(mooncake_distributions()) or "Mooncake not installed"


def format_report(report: DemoReport) -> str:
    """The demo's result table."""
    config = report.config
    planner = f"gpu_planner ({index_device().type})" if config.planner == "gpu" else "reference"
    planning_side = "prefill" if config.mode == "push" else "decode"
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
        ("mode / planner", f"{config.mode} / {planner} on {planning_side}"),
        ("buffers", f"{config.buffers} ({sum(config.is_device)} device-backed)"),
        ("pages", f"{report.pages} ({config.tokens} tokens, page size {config.page_size})"),
        ("runs host / device", f"{report.host_runs} / {report.device_runs}"),
        ("descriptors", f"{report.descriptors} (max {config.max_batch_pages} pages per batch)"),
        ("plan time", f"{report.plan_s * 1e3:.2f} ms"),
        ("Mooncake hand-off", f"{report.handoff} ({_mooncake_version()})"),
        ("submit time", f"{report.submit_s * 1e3:.2f} ms"),
        ("bytes", f"{report.total_bytes} ({report.total_bytes / 2**20:.1f} MiB)"),
        ("throughput", f"{rate:.3f} GB/s"),
        ("verification", verdict),
    ]
    rows += [("error", error) for error in report.errors]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)

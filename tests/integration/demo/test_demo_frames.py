"""A malformed metadata message ends the demo's exchange cleanly on both sides.

A hostile peer process (`demo_support`) sends one message with a frame
truncated, of the wrong length or out of range. The planning side reports a
`FrameError` naming the field (never `struct.error` or `IndexError`) and tells
the peer, when the message that says where the peer listens is intact; else
the peer times out (a bounded wait). Either way both processes end, and a real
peer that receives a malformed message exits with one line, not a traceback.
"""

from __future__ import annotations

import functools
import time

import pytest
from demo_support import (
    TIMED_OUT,
    TOLD,
    pull_prefill_sending,
    push_decode_sending,
    small_config,
)

from gpu_planner.integration.demo import run
from gpu_planner.integration.demo.run import TransferMode, run_demo
from gpu_planner.integration.demo.sides import DONE, PrefillSide

TIMEOUT_S = 10.0  # covers the peer's start (the fork server's imports, the engine) when loaded
MALFORMED = {
    # (mode, message, frame, new value): the error's text, and what the peer hears
    "push-registration-truncated": ("push", "registration", None, b"", "23", TOLD),
    "push-registration-port--1": ("push", "registration", 2, b"-1", "port = -1", TOLD),
    "push-registration-port-2**70": ("push", "registration", 2, b"%d" % 2**70, "port =", TOLD),
    "push-registration-ptrs-3-bytes": ("push", "registration", 4, b"abc", "ptrs: 3 bytes", TOLD),
    "push-registration-rank-text": ("push", "registration", 7, b"x1", "tp_rank", TOLD),
    "push-request-pages-3-bytes": ("push", "request", 4, b"abc", "host_pages", TIMED_OUT),
    "push-request-port-0": ("push", "request", 2, b"0", "port = 0", TIMED_OUT),
    "pull-source-truncated": ("pull", "source", None, b"", "2 frames", TOLD),
    "pull-source-negative-page": ("pull", "source", 2, b"\xff" * 4, "pages[0] = -1", TOLD),
    "pull-registration-lens": ("pull", "registration", 21, b"\x01" * 8, "lens", TIMED_OUT),
}


@pytest.mark.parametrize(
    ("mode", "message", "frame", "value", "error", "peer_hears"),
    MALFORMED.values(),
    ids=MALFORMED.keys(),
)
def test_a_malformed_message_is_a_frame_error_and_ends_both_sides(
    monkeypatch, mode, message, frame, value, error, peer_hears
):
    hostile = push_decode_sending if mode == "push" else pull_prefill_sending
    initiator = run.MODES[mode]
    peer = functools.partial(hostile, message, frame, value)
    monkeypatch.setitem(run.MODES, mode, TransferMode(initiator.initiator, initiator.run, peer))
    start = time.monotonic()
    report = run_demo(small_config(mode=mode, timeout_s=TIMEOUT_S))
    assert time.monotonic() - start < 4 * TIMEOUT_S  # every wait was bounded
    assert report.errors[0].startswith("FrameError: "), report.errors
    assert error in report.errors[0]
    peer_exits = [e for e in report.errors if e.startswith("peer process exited with code")]
    if peer_hears == TOLD:  # told of the FrameError, the peer ended with exit code 0
        assert peer_exits == []
    else:  # its address was in the malformed message: the peer timed out
        assert peer_exits == [f"peer process exited with code {TIMED_OUT}"]


def truncated_outcome(prefill: PrefillSide, report: run.DemoReport) -> None:
    """A planning side whose word to decode lacks its pages frame."""
    _, request = prefill.receive_metadata()
    prefill.outbox(request.endpoint, request.port).send_multipart([DONE, b"1"])


def test_a_real_peer_given_a_malformed_message_exits_with_one_line(monkeypatch, capfd):
    """The real decode process: a FrameError, one line on stderr, exit code 1, no traceback."""
    monkeypatch.setitem(
        run.MODES, "push", TransferMode(PrefillSide, truncated_outcome, run.run_push_decode)
    )
    report = run_demo(small_config(timeout_s=TIMEOUT_S))
    assert report.errors == ["peer process exited with code 1"]
    stderr = capfd.readouterr().err
    assert "gpu-planner demo (decode process): FrameError: not a transfer outcome" in stderr
    assert "Traceback" not in stderr

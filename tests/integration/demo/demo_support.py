"""The demo tests' small configuration: the demo's two processes, moving a few hundred KiB."""

from __future__ import annotations

import dataclasses

from gpu_planner.integration.demo.config import DemoConfig

SMALL = DemoConfig(
    buffers=6,
    device_fraction=0.5,
    tokens=1024,
    page_size=16,
    item_len=128,
    mean_run=4.0,
    max_batch_pages=7,
    timeout_s=30.0,
)


def small_config(**changes) -> DemoConfig:
    """A demo configuration that moves a few hundred KiB: fast on two CPU cores."""
    return dataclasses.replace(SMALL, **changes)


# Exit codes of the hostile peers below.
TOLD, TIMED_OUT, NOT_TOLD = 0, 4, 3


def _edited(frames: list[bytes], index: int | None, value: bytes) -> list[bytes]:
    """`frames` with frame `index` replaced by `value`; index None drops the last frame."""
    if index is None:
        return frames[:-1]
    return [value if i == index else frame for i, frame in enumerate(frames)]


def _await_failure_word(side, waiting_for: str) -> None:
    """Exit TOLD when the planning side reports a FrameError, TIMED_OUT when it says nothing."""
    from gpu_planner.integration.demo.sides import Outcome

    try:
        outcome = Outcome.from_frames(side.receive(waiting_for))
    except TimeoutError:
        raise SystemExit(TIMED_OUT) from None
    told = outcome.sent_pages is None and outcome.failure.startswith("FrameError")
    raise SystemExit(TOLD if told else NOT_TOLD)


def push_decode_sending(
    message: str, index: int | None, value: bytes, config: DemoConfig, prefill_port: int
) -> None:
    """A decode peer whose `message` ("registration" or "request") has frame `index` edited."""
    from gpu_planner.integration.demo.config import LOCALHOST
    from gpu_planner.integration.demo.sides import DecodeSide

    with DecodeSide(config) as decode:
        frames = {
            "registration": decode.registration().to_frames(),
            "request": decode.transfer_request().to_frames(),
        }
        frames[message] = _edited(frames[message], index, value)
        to_prefill = decode.outbox(LOCALHOST, prefill_port)
        to_prefill.send_multipart(frames["registration"])
        to_prefill.send_multipart(frames["request"])
        _await_failure_word(decode, "the transfer outcome")


def pull_prefill_sending(
    message: str, index: int | None, value: bytes, config: DemoConfig, decode_port: int
) -> None:
    """A prefill peer whose `message` ("registration" or "source") has frame `index` edited."""
    from gpu_planner.integration.demo.config import LOCALHOST
    from gpu_planner.integration.demo.sides import ROOM, PrefillSide
    from gpu_planner.integration.sglang.frames import SourcePages

    with PrefillSide(config) as prefill:
        source = SourcePages(ROOM, prefill.session_id, prefill.src_pages)
        frames = {"registration": prefill.registration().to_frames(), "source": source.to_frames()}
        frames[message] = _edited(frames[message], index, value)
        to_decode = prefill.outbox(LOCALHOST, decode_port)
        to_decode.send_multipart(frames["registration"])
        to_decode.send_multipart(frames["source"])
        _await_failure_word(prefill, "the transfer outcome")

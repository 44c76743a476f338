"""sglang's rules for handing descriptors to Mooncake, in one place.

sglang's `MooncakeTransferEngine.batch_transfer_sync` hands Mooncake Python
lists, turns any exception into -1 and logs a failed call at DEBUG. Through
sglang's own wrapper class (not a subclass that overrides that method) around
a Mooncake engine with the arrays API (0.3.14+), the hooks call
`batch_transfer_sync_write_arrays` on the engine directly with views of the
plan's columns, under the same rules; any other wrapper gets its own method,
with lists, so whatever it does still happens.
"""

from __future__ import annotations

import logging

from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
    MooncakeTransferEngine,
)

from gpu_planner.integration.mooncake import handoff

logger = logging.getLogger(__name__)


def sglang_handoff(wrapper: object) -> handoff.Handoff:
    """The hand-off a hook uses to send through sglang's engine `wrapper`, as sglang would."""
    engine = getattr(wrapper, "engine", None)
    if (
        getattr(type(wrapper), "batch_transfer_sync", None)
        is not MooncakeTransferEngine.batch_transfer_sync
        or handoff.engine_form(type(engine), "write") != handoff.ARRAYS
    ):
        return handoff.Handoff(handoff.LISTS, wrapper.batch_transfer_sync)
    write_arrays = engine.batch_transfer_sync_write_arrays

    def write(
        session: str, srcs: handoff.Column, dsts: handoff.Column, lens: handoff.Column
    ) -> int:
        try:
            status = write_arrays(session, srcs, dsts, lens)
        except Exception:  # sglang's wrapper: any engine exception is status -1
            status = -1
        if status < 0:
            logger.debug("Failed to batch transfer %d descriptors to %s", len(lens), session)
        return status

    return handoff.Handoff(handoff.ARRAYS, write)

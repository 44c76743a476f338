"""sglang's rules for handing descriptors to Mooncake, in one place.

sglang makes every engine call through `MooncakeKVManager._transfer_data`,
which hands its engine wrapper's `batch_transfer_sync` Python lists; sglang's
`MooncakeTransferEngine.batch_transfer_sync` turns any exception into -1 and
logs a failed call at DEBUG. A hook makes those calls itself (no tuple per
descriptor) only where that is exactly what `_transfer_data` would do: on a
manager whose `_transfer_data` is sglang's own (`check_manager`; an override
in a subclass, a test or another plugin gets sglang's code instead). Through
sglang's own wrapper class (not a subclass that overrides that method) around
a Mooncake engine with the arrays API (0.3.14+), the hooks call
`batch_transfer_sync_write_arrays` on the engine directly with views of the
plan's columns, under the same rules; any other wrapper gets its own method,
with lists, so whatever it does still happens. Each call is marked on the
hooked call's `SendProgress` before it starts (the hook contract: `fallback`).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
from sglang.srt.disaggregation.mooncake import conn
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
    MooncakeTransferEngine,
)

from gpu_planner import settings
from gpu_planner.integration.mooncake import handoff
from gpu_planner.integration.sglang.fallback import Fallback, current_send

logger = logging.getLogger(__name__)


def check_manager(manager: object, kv_fields: tuple[str, ...]) -> None:
    """`Fallback` unless `manager` has what a hook reads, and makes engine calls as sglang's does.

    sglang's unit tests build partial managers (`SimpleNamespace`,
    `object.__new__(MooncakeKVManager)` with the attributes one function
    reads); those, and managers whose `_transfer_data` is not sglang's own,
    get sglang's code.
    """
    transfer_data = getattr(manager, "_transfer_data", None)
    if getattr(transfer_data, "__func__", None) is not conn.MooncakeKVManager._transfer_data:
        raise Fallback(
            "the manager's _transfer_data is not sglang's own (overridden by a subclass, a test "
            "or another plugin)",
            key="_transfer_data overridden",
        )
    kv_args = getattr(manager, "kv_args", None)
    missing = [field for field in kv_fields if getattr(kv_args, field, None) is None]
    if kv_args is None or missing or getattr(manager, "engine", None) is None:
        raise Fallback(
            "a manager without its engine or kv_args "
            f"({', '.join(missing) if kv_args is not None and missing else 'kv_args, engine'})",
            key="partial manager",
        )


def sglang_handoff(wrapper: object) -> handoff.Handoff:
    """The hand-off a hook uses to send through sglang's engine `wrapper`, as sglang would.

    `Fallback` where `GPU_PLANNER_HANDOFF` asks for a form the engine lacks.
    """
    progress = current_send()
    engine = getattr(wrapper, "engine", None)
    asked = settings.loaded(settings.HANDOFF)
    if not _calls_engine_arrays(type(wrapper), type(engine), asked):
        wrapper_call = wrapper.batch_transfer_sync

        def write_lists(
            session: str, srcs: handoff.Column, dsts: handoff.Column, lens: handoff.Column
        ) -> int:
            progress.engine_call_starting()
            return wrapper_call(session, srcs, dsts, lens)

        return handoff.Handoff(handoff.LISTS, write_lists)
    write_arrays = engine.batch_transfer_sync_write_arrays

    def write(
        session: str, srcs: handoff.Column, dsts: handoff.Column, lens: handoff.Column
    ) -> int:
        progress.engine_call_starting()
        try:
            status = write_arrays(session, srcs, dsts, lens)
        except Exception:  # sglang's wrapper: any engine exception is status -1
            status = -1
        if status < 0:
            logger.debug("Failed to batch transfer %d descriptors to %s", len(lens), session)
        return status

    return handoff.Handoff(handoff.ARRAYS, write)


# What `AsyncWrites` calls (Mooncake 0.3.14's binding has both).
ASYNC_METHODS = ("batch_transfer_async_write_arrays", "get_batch_transfer_status")


class AsyncWrites:
    """The engine's asynchronous arrays writes, one descriptor each, under `sglang_handoff`'s
    rules (its status as sglang's wrapper gives it: any exception is -1).

    `submit` starts one write and returns a batch id (0: none started, which
    `wait` reports as -1); `wait` blocks (without the GIL) until that write
    ended: 0 once its bytes landed, -1 if it failed.
    """

    def __init__(self, engine: object) -> None:
        self._progress = current_send()
        self._submit = engine.batch_transfer_async_write_arrays
        self._status = engine.get_batch_transfer_status

    def submit(self, session: str, src: int, dst: int, nbytes: int) -> int:
        self._progress.engine_call_starting()
        columns = (np.array([value], dtype=np.int64) for value in (src, dst, nbytes))
        try:
            return int(self._submit(session, *columns))
        except Exception:
            logger.debug("Failed to submit a write of %d bytes to %s", nbytes, session)
            return 0

    def wait(self, batch: int) -> int:
        if not batch:
            return -1
        try:
            return 0 if self._status([batch]) == 0 else -1
        except Exception:
            return -1


def sglang_async_writes(wrapper: object) -> AsyncWrites | None:
    """Where a hook calls the engine itself (`sglang_handoff`: arrays) and the engine writes
    asynchronously: its writes; else None (the hook makes `sglang_handoff`'s calls)."""
    engine = getattr(wrapper, "engine", None)
    asked = settings.loaded(settings.HANDOFF)
    if not _calls_engine_arrays(type(wrapper), type(engine), asked):
        return None
    if not all(hasattr(engine, name) for name in ASYNC_METHODS):
        return None
    return AsyncWrites(engine)


@functools.lru_cache(maxsize=64)
def _calls_engine_arrays(wrapper_type: type, engine_type: type, asked: str) -> bool:
    """Whether a hook calls the engine's arrays method itself (else the wrapper, with lists).

    Decided once per wrapper class, engine class and `GPU_PLANNER_HANDOFF`
    (`asked`, all the decision reads of the knobs); `Fallback` where it asks
    for a form the engine lacks.
    """
    try:
        engine_form = handoff.engine_form(engine_type, "write")
    except settings.SettingError as error:
        raise Fallback(str(error), key="handoff unavailable") from None
    if (
        getattr(wrapper_type, "batch_transfer_sync", None)
        is MooncakeTransferEngine.batch_transfer_sync
        and engine_form == handoff.ARRAYS
    ):
        return True
    if asked == handoff.ARRAYS:
        raise Fallback(
            f"{settings.HANDOFF.name}=arrays, but the engine wrapper "
            f"{wrapper_type.__qualname__} is not sglang's MooncakeTransferEngine",
            key="handoff unavailable",
        )
    return False

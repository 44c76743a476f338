"""The one place descriptors are handed to a Mooncake engine: arrays if it can, else lists.

Mooncake 0.3.14 added `batch_transfer_sync_{write,read}_arrays`, which take
buffer-protocol int64 arrays: the plan's host columns go in as contiguous row
views (one slice per call), and no Python list of descriptors is built. Older
engines only take `list[int]`s. A `Handoff` is built once per engine and
direction: it knows its form (chosen once per engine class, logged once;
`GPU_PLANNER_HANDOFF` can force one), yields a plan's pieces in that form and
makes the call. Every module that moves descriptors goes through one: the
sender and reader (`transfer`), the demo, and the sglang hooks (through the
sglang adapter, which adds sglang's own wrapper rules).

Mooncake's read takes the local buffers first, then the peer's addresses; in a
plan those are the destinations and the sources, so a read passes
`(dsts, srcs)`. Only Mooncake's Python API is called (its C++ request struct
changes size between releases).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import numpy as np

from gpu_planner import settings
from gpu_planner.plan import PlanPiece, TransferPlan, exact_total

logger = logging.getLogger(__name__)

ARRAYS = "arrays"
LISTS = "lists"
Direction = Literal["write", "read"]
HandoffForm = Literal["arrays", "lists"]
Column = Sequence[int] | np.ndarray  # a list in the list form, an int64 view in the arrays form
EngineMethod = Callable[[str, Column, Column, Column], int]  # (peer, local, remote, lens)


@functools.cache
def _engine_has_arrays(engine_type: type, direction: Direction) -> bool:
    return hasattr(engine_type, f"batch_transfer_sync_{direction}_arrays")


@functools.cache
def _log_form_once(engine_type: type, direction: Direction, form: HandoffForm) -> None:
    """Log, once per engine class, direction and form, which hand-off it gets and why."""
    if settings.loaded(settings.HANDOFF) != "auto":
        reason = f"{settings.HANDOFF.name}={form}"
    elif form == ARRAYS:
        reason = "the engine has batch_transfer_sync_*_arrays"
    else:
        reason = "the engine has no *_arrays methods (Mooncake < 0.3.14)"
    logger.info(
        "gpu_planner: Mooncake %s hand-off through %s (%s.%s: %s)",
        direction,
        form,
        engine_type.__module__,
        engine_type.__qualname__,
        reason,
    )


def engine_form(engine_type: type, direction: Direction = "write") -> HandoffForm:
    """The form every engine of class `engine_type` takes descriptors in (`GPU_PLANNER_HANDOFF`).

    `auto`: arrays where the class has the arrays method, else lists. `arrays`
    on a class without it is a `settings.SettingError`.
    """
    has_arrays = _engine_has_arrays(engine_type, direction)
    asked = settings.loaded(settings.HANDOFF)
    if asked == ARRAYS and not has_arrays:
        raise settings.SettingError(
            f"{settings.HANDOFF.name}=arrays, but {engine_type.__qualname__} has no "
            f"batch_transfer_sync_{direction}_arrays (Mooncake < 0.3.14)"
        )
    form: HandoffForm = ARRAYS if has_arrays and asked != LISTS else LISTS
    _log_form_once(engine_type, direction, form)
    return form


class Handoff:
    """How one engine takes descriptors in one direction, and the call that hands them over.

    `method` is the engine call for `form`, with Mooncake's argument order (local
    buffers first). `Handoff.of(engine, direction)` picks both for a Mooncake engine.
    """

    def __init__(
        self, form: HandoffForm, method: EngineMethod, direction: Direction = "write"
    ) -> None:
        self.form = form
        self.direction = direction
        self._method = method

    @classmethod
    def of(
        cls, engine: object, direction: Direction = "write", form: HandoffForm | None = None
    ) -> Handoff:
        """`engine`'s hand-off for `direction` (form detected unless given)."""
        form = form or engine_form(type(engine), direction)
        suffix = "_arrays" if form == ARRAYS else ""
        return cls(form, getattr(engine, f"batch_transfer_sync_{direction}{suffix}"), direction)

    def pieces(self, plan: TransferPlan, per_buffer: bool = False) -> Iterator[PlanPiece]:
        """`plan`'s calls in order (per batch, or per batch and buffer), in this form."""
        return plan.pieces(per_buffer=per_buffer, lists=self.form == LISTS)

    def columns(
        self, srcs: np.ndarray, dsts: np.ndarray, lens: np.ndarray, equal_lens: bool = False
    ) -> tuple[Column, ...]:
        """int64 columns in this form: as they are for arrays, `.tolist()` for lists.

        `equal_lens`: every length is the same, so the list repeats one int object
        (as sglang builds it) instead of allocating one per descriptor.
        """
        if self.form == ARRAYS:
            return srcs, dsts, lens
        lens_list = [int(lens[0])] * lens.size if equal_lens and lens.size else lens.tolist()
        return srcs.tolist(), dsts.tolist(), lens_list

    def call(self, peer: str, srcs: Column, dsts: Column, lens: Column) -> int:
        """One synchronous engine call with the plan's (src, dst, len) columns; its status."""
        if self.direction == "read":
            return self._method(peer, dsts, srcs, lens)
        return self._method(peer, srcs, dsts, lens)


def column_total(column: Column) -> int:
    """The exact sum of a list or array column (bytes, for a lengths column): a Python int."""
    return exact_total(column) if isinstance(column, np.ndarray) else sum(column)

"""Every hooked send's path, decided in one place: `generic_path` and `slice_path`.

The paths, each counted once per send under the path it takes and why
(`gpu_planner:paths_chosen_total{path, reason}`; its `sends_total{hook}` twin
in parentheses):
- `direct` (`generic`): a generic send's planned descriptors, sglang's calls;
- `staged` (`staged`): written into the decode's receive staging
  (`staged_send`), scattered by the decode;
- `gathered` (`gathered`): a TP-up head-sliced send gathered into send slots
  as whole decode pages (`gathered`);
- `per-token` (`slice`): a head-sliced send's per-token descriptors, as
  sglang's (`send_slice`).
sglang's own code runs instead where a hook raises `Fallback` before any of
this (inputs the planner does not model), counted as `fallbacks_total`.

A decision, in order:
1. routing: a generic send goes direct or staged; a head-sliced send from a
   higher prefill TP (TP-down) staged or per token; from a lower one (TP-up)
   gathered or per token;
2. eligibility: the decode advertised receive staging, the send's buffers
   can be staged, this prefill has send slots a page fits in;
3. the price (staging only): the cost model (`path_cost`), or the gate a user
   set;
4. the line-up (staging priced faster): the decode lent this request a part
   that matches the send (`staged_send.line_up`);
5. the send's first slot (staged and gathered): none free, the other path.
Only then is the path counted, and where the model priced the send, the
model told which path it took (`PathCosts.taken`); the send's time teaches
the model when the decode offers staging (`observe`). Every reason is a
constant of this module or of the module that finds it: a fixed set of
counter labels; what varies (sizes, errors) goes to the log, once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_planner.head_slices import HeadSliceLayout
from gpu_planner.integration.sglang import gathered, staged_send
from gpu_planner.integration.sglang.counters import record_path_choice
from gpu_planner.integration.sglang.fallback import current_send, log_fallback_once, log_once
from gpu_planner.integration.sglang.path_cost import DIRECT, STAGED, path_costs
from gpu_planner.integration.sglang.prefill_routes import ROUTES
from gpu_planner.integration.sglang.send_slots import (
    SEND_SLOTS,
    SLOTS,
    PartWrites,
    SendSlots,
    SlotLease,
)

GATHERED = "gathered"
PER_TOKEN = "per-token"
PATHS = (DIRECT, STAGED, GATHERED, PER_TOKEN)

# Why a send takes the path it takes, where no module below finds the reason.
NO_STAGING_OFFERED = "the decode offers no receive staging"
UNEQUAL_PAGES = "page lists of unequal lengths"
DEFERRED_BOOTSTRAP = "sglang publishes this prefill's Success later (deferred bootstrap)"
NO_SEND_SLOTS = "this prefill has no send slots"
PAGE_EXCEEDS_SLOT = "a page of every buffer exceeds a send slot"
SLOTS_BUSY = "every send slot is lent to other sends or held"
TP_UP = "prefill attention TP below the decode's: whole decode pages gathered"
EQUAL_TP = "equal attention TP"
NO_PAGES = "no pages"
SWA_STATE = "SWA state head slices"

# Reasons too common to log: those of every send of a deployment without receive staging.
_QUIET = frozenset({NO_STAGING_OFFERED, TP_UP, NO_PAGES, SWA_STATE})


@dataclass(frozen=True)
class PathDecision:
    """One send's path and why; a staged or gathered decision holds the send's first slot in
    `lease` (the writer enters it at once: leaving it gives every slot back)."""

    path: str
    reason: str
    lease: SlotLease | PartWrites | None = None
    staged_write: staged_send.StagedWrite | None = None
    gathered_send: gathered.GatheredSend | None = None


def generic_path(
    manager: Any,
    session: str,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    entries: staged_send.StagedEntries | str,
    descriptors: int,
) -> PathDecision:
    """A planned generic send's path: staged where the decode offers staging, the model prices
    it faster, the request lines up and a slot is free; else direct. `entries`: the send's
    buffers as staging moves them, or why they cannot be staged."""
    staged = _staged(manager, session, src_pages, dst_pages, entries, descriptors)
    if isinstance(staged, PathDecision):
        return staged
    return _decided(PathDecision(DIRECT, staged))


def slice_path(
    manager: Any,
    session: str,
    layout: HeadSliceLayout,
    pages: tuple[np.ndarray, np.ndarray],
    dst_kv_indices: np.ndarray,
    dst_attn_tp_size: int,
) -> PathDecision:
    """A head-sliced KV send's path: TP-down staged (as `generic_path`), TP-up gathered where
    a slot is free; else per token.

    `pages` are both page lists flattened; `dst_kv_indices` the decode pages as
    sglang handed them (their base array names the request).
    """
    src_pages = pages[0]
    if not src_pages.size:
        return _decided(PathDecision(PER_TOKEN, NO_PAGES))
    if manager.attn_tp_size > dst_attn_tp_size:
        if ROUTES.capability(session) is None:
            return _decided(PathDecision(PER_TOKEN, NO_STAGING_OFFERED))
        staged = _staged(
            manager, session, src_pages, dst_kv_indices,
            staged_send.StagedEntries.of_head_slices(layout),
            layout.num_layers * src_pages.size * layout.page_size,  # one per token per buffer
        )  # fmt: skip
        if isinstance(staged, PathDecision):
            return staged
        return _decided(PathDecision(PER_TOKEN, staged))
    if not gathered.gathers(manager.attn_tp_size, dst_attn_tp_size):
        return _decided(PathDecision(PER_TOKEN, EQUAL_TP))
    slots = SEND_SLOTS.get(manager)
    if isinstance(slots, str):
        needed = SLOTS * int(layout.geometry[1, 1].max())  # a decode page per slot, at least
        detail = f"{slots}; it needs at least {needed} bytes"
        return _decided(PathDecision(PER_TOKEN, NO_SEND_SLOTS), detail)
    send = gathered.gathered_send(manager, slots, layout, pages[1], src_pages.size)
    if isinstance(send, str):
        return _decided(PathDecision(PER_TOKEN, send))
    slot = slots.try_take()
    if slot is None:
        return _decided(PathDecision(PER_TOKEN, SLOTS_BUSY))
    lease = SlotLease(slots, slot, current_send().futures)
    return _decided(PathDecision(GATHERED, TP_UP, lease, gathered_send=send))


def swa_slice_path() -> PathDecision:
    """An SWA state head-sliced send: per token (its state pages are not staged)."""
    return _decided(PathDecision(PER_TOKEN, SWA_STATE))


def _staged(
    manager: Any,
    session: str,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    entries: staged_send.StagedEntries | str,
    descriptors: int,
) -> PathDecision | str:
    """The staged decision for this send (its first slot taken), or why it goes its other way."""
    if ROUTES.capability(session) is None:
        return NO_STAGING_OFFERED
    if isinstance(entries, str):  # the send's buffers cannot be staged: why
        return entries
    if dst_pages.size != src_pages.size:
        return UNEQUAL_PAGES
    if getattr(manager, "deferred_bootstrap", None) is not None:
        return DEFERRED_BOOTSTRAP
    slots = SEND_SLOTS.get(manager)
    if isinstance(slots, str):
        _log(DIRECT, NO_SEND_SLOTS, slots)
        return NO_SEND_SLOTS
    chunk_page_bytes = entries.chunk_page_bytes
    pages_per_slot = slots.slot_bytes // chunk_page_bytes
    if pages_per_slot == 0:
        _log(DIRECT, PAGE_EXCEEDS_SLOT, f"{chunk_page_bytes} bytes, slots of {slots.slot_bytes}")
        return PAGE_EXCEEDS_SLOT
    num_pages = src_pages.size
    nbytes = num_pages * chunk_page_bytes
    costs = path_costs()
    choice = costs.choose(session, descriptors, nbytes, -(-num_pages // pages_per_slot))
    reason = choice.reason
    if choice.staged:
        lined_up = staged_send.line_up(manager, session, dst_pages, entries, num_pages)
        lease = None if isinstance(lined_up, str) else _first_slot(manager, slots, session)
        if lease is not None:
            costs.taken(session, choice, STAGED)
            chunks = [
                (first, min(pages_per_slot, num_pages - first))
                for first in range(0, num_pages, pages_per_slot)
            ]
            write = staged_send.StagedWrite(entries, lined_up, slots, chunks, nbytes)
            return _decided(PathDecision(STAGED, reason, lease, staged_write=write))
        reason = lined_up if isinstance(lined_up, str) else SLOTS_BUSY
    costs.taken(session, choice, DIRECT)
    return reason


def _first_slot(manager: Any, slots: SendSlots, session: str) -> SlotLease | PartWrites | None:
    """A lease on a free slot, for the writes this engine and these slots make; None: none free."""
    writes = staged_send.part_writes(manager, slots)  # before the slot: it may raise
    slot = slots.try_take()
    if slot is None:
        return None
    if writes is None:
        return SlotLease(slots, slot, current_send().futures)
    return PartWrites(slots, slot, writes, session)


def _decided(decision: PathDecision, detail: str | None = None) -> PathDecision:
    """Count `decision` (once per send, here only), logging an unusual reason once."""
    record_path_choice(decision.path, decision.reason)
    if detail is not None or decision.reason not in _QUIET:
        _log(decision.path, decision.reason, detail)
    return decision


def _log(path: str, reason: str, detail: str | None = None) -> None:
    """Log the first send of `path` for `reason`, with what varies (`detail`) in the message."""
    suffix = f" ({detail})" if detail else ""
    log_once(
        logging.INFO, f"gpu_planner: a send goes {path}: {reason}{suffix}", f"{path}: {reason}"
    )


def send_staged(
    manager: Any,
    session: str,
    decision: PathDecision,
    src_pages: np.ndarray,
    executor: Any,
    started: float,
) -> int:
    """Write a staged decision (`staged_send.write_staged`); its time teaches the model."""
    write = decision.staged_write
    assert write is not None and decision.lease is not None
    status = staged_send.write_staged(
        manager, session, write, decision.lease, src_pages, executor, started
    )
    if status == 0:
        observe(session, STAGED, len(write.chunks), write.nbytes, time.perf_counter() - started)
    return status


def observe(session: str, path: str, requests: int, nbytes: int, seconds: float) -> None:
    """A send to `session` completed on `path`: its time teaches the cost model, where that
    decode offers staging (the only peers it chooses for). Never raises: the send's status
    stands."""
    if ROUTES.capability(session) is None:
        return
    try:
        path_costs().observe(session, path, requests, nbytes, seconds, True)
    except Exception as error:
        log_fallback_once(f"the cost model did not take a send ({error})", key="cost model")

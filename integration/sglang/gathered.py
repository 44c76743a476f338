"""Head-sliced KV sends gathered into send slots: whole decode pages, equal-TP counts.

When the prefill's attention TP is below the decode's, each decode rank takes
one head range of every prefill token and holds it as whole token slots of its
own pages. sglang's `send_kvcache_slice` sends one descriptor per token per
K/V buffer per layer; here each chunk of K/V buffers is first gathered
(`gpu_planner.head_gather`) into a send slot (`send_slots`) laid out as the
decode pages, then sent as one descriptor per run of consecutive decode pages
per buffer: the descriptor count of an equal-TP send of the same pages, or
fewer. `send_path` decides whether a send goes this way (and takes its first
slot); `write_gathered` writes it.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_planner.errors import PlanValidationError
from gpu_planner.head_gather import chunk_layout, gathered_descriptors
from gpu_planner.head_slices import HeadSliceLayout
from gpu_planner.integration.sglang import bounds
from gpu_planner.integration.sglang.adapter import sglang_handoff
from gpu_planner.integration.sglang.counters import record_send
from gpu_planner.integration.sglang.send_slots import (
    Chunk,
    SendSlots,
    SlotLease,
    gather_into_slot,
    piece_executor,
)
from gpu_planner.plan import exact_total

# Why a head-sliced send cannot go gathered (`send_path` counts the send per-token under it).
NO_PAGE_BYTES = "decode pages of 0 bytes"
PAGE_EXCEEDS_SLOT = "a decode page of every buffer exceeds a send slot"
SOURCE_OUTSIDE = "a source buffer outside the prefill's registered memory"
GATHER_REJECTED = "the gather rejected the send's layout"


def gathers(src_attn_tp_size: int, dst_attn_tp_size: int) -> bool:
    """Whether a head-sliced send between these attention TP sizes can take the gathered path.

    Prefill TP below decode TP (replication included): each decode token slot
    is written whole by one prefill rank. Above it, several prefill ranks
    write parts of each decode slot.
    """
    return src_attn_tp_size < dst_attn_tp_size


@dataclass(frozen=True)
class GatheredSend:
    """How one head-sliced send goes gathered: its chunks and each chunk's descriptors."""

    slots: SendSlots
    layout: HeadSliceLayout
    chunks: list[Chunk]
    columns: list[np.ndarray]  # per chunk: int64 [3, descriptors] (slot offsets, dsts, lens)
    src_lens: np.ndarray  # each entry's registered source bytes


def gathered_send(
    manager: Any, slots: SendSlots, layout: HeadSliceLayout, dst_pages: np.ndarray, num_pages: int
) -> GatheredSend | str:
    """What the gathered send of `layout`'s `num_pages` pages needs, or why it cannot go so
    (one of this module's reasons)."""
    page_bytes = int(layout.geometry[1, 1].max())
    if page_bytes == 0:
        return NO_PAGE_BYTES
    chunks = plan_chunks(layout.num_layers, num_pages, page_bytes, slots.slot_bytes)
    if chunks is None:
        return PAGE_EXCEEDS_SLOT
    src_lens = bounds.registered_room(manager.kv_args, layout.geometry[0, 0])
    if (src_lens < 0).any():
        return SOURCE_OUTSIDE
    try:
        columns = [
            gathered_descriptors(chunk_layout(layout, chunk.entries), dst_pages[chunk.pages], 0)
            for chunk in chunks
        ]
    except PlanValidationError:
        return GATHER_REJECTED
    return GatheredSend(slots, layout, chunks, columns, src_lens)


def plan_chunks(
    num_entries: int, num_pages: int, page_bytes: int, slot_bytes: int
) -> list[Chunk] | None:
    """Chunks of at most `slot_bytes` staged bytes each; None when one staged page does not fit.

    Whole entries while a slot holds every page of one: as many entries per
    chunk as fit (one engine call each), so no run of pages is cut. Else one
    entry per chunk, its pages cut into slot-sized pieces (a run crossing a
    cut becomes two descriptors).
    """
    pages_per_slot = slot_bytes // page_bytes
    if pages_per_slot == 0:
        return None
    if num_pages <= pages_per_slot:
        per_chunk = pages_per_slot // max(num_pages, 1)
        return [
            Chunk(slice(first, min(first + per_chunk, num_entries)), slice(0, num_pages))
            for first in range(0, num_entries, per_chunk)
        ]
    return [
        Chunk(slice(entry, entry + 1), slice(first, min(first + pages_per_slot, num_pages)))
        for entry in range(num_entries)
        for first in range(0, num_pages, pages_per_slot)
    ]


def write_gathered(
    manager: Any,
    session: str,
    send: GatheredSend,
    lease: SlotLease,
    src_pages: np.ndarray,
    executor: concurrent.futures.Executor,
    started: float,
) -> int:
    """Gather and write each chunk of `send` through `lease` (its first slot taken), one engine
    call per chunk from `executor`; 0 or the first failing status, as sglang's send returns it.

    `started` (perf_counter) is when the send began: its plan time counted.
    """
    engine_handoff = sglang_handoff(manager.engine)
    futures = lease.futures
    with lease:  # whatever raises, slots go back once no call reads them
        record_send(
            "gathered",
            engine_handoff.form,
            sum(column.shape[1] for column in send.columns),
            sum(exact_total(column[2]) for column in send.columns),
            time.perf_counter() - started,
            send.layout.num_layers,
            len(send.chunks),
        )
        executor = piece_executor(executor, len(send.chunks))
        for chunk, (offsets, dsts, lens) in zip(send.chunks, send.columns, strict=True):
            slot = lease.next_slot()  # may wait for this send's own call
            if slot is None:
                break  # sglang stops at a failed layer; no more chunks are gathered
            ready = gather_into_slot(send.slots, slot, send.layout, chunk, src_pages, send.src_lens)
            srcs = offsets + send.slots.slot(slot).data_ptr()
            lease.write(slot, executor, engine_handoff, session, ready, (srcs, dsts, lens))
        return manager._await_transfer_futures(futures)  # slots of ended calls back on return

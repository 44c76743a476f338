"""Hypothesis scenarios for sglang's `_send_kvcache_generic`: layouts, pages, manager state.

A scenario is everything one call depends on: the manager state (backend
kind, PP stage, custom memory pool, batch limit, validated peers), the call
arguments (pointers, item lengths, layer ids, state type, page lists, HiSparse
device pointers and pages) and the engine's answers (success or a failure).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import strategies as st
from sglang_plugin_support import conn

StateType = conn.StateType
SESSION = "127.0.0.1:12345"
LAYOUT_KINDS = ("mla", "hybrid_mla", "force_flat", "layer_ids", "mha", "swa_single")
PAGE_STEPS = (1, 1, 1, 1, 2, 0, -7, 13)
ITEM_LENS = (64, 128, 576)


@dataclasses.dataclass
class SendScenario:
    manager: dict
    call: dict
    engine: dict
    threaded: bool


def _ptrs(base: int, count: int) -> list[int]:
    """Distinct 64-bit-range buffer addresses, 4 GiB apart."""
    return [base + i * (1 << 32) for i in range(count)]


@st.composite
def page_list(draw, num_pages: int) -> np.ndarray:
    """Pages stepping mostly by +1, with breaks, repeats and jumps back."""
    steps = draw(st.lists(st.sampled_from(PAGE_STEPS), min_size=num_pages, max_size=num_pages))
    start = draw(st.integers(400, 1000))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    return (start + np.cumsum([0, *steps[1:]])).astype(dtype)[:num_pages]


def item_len_lists(count: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.sampled_from(ITEM_LENS), min_size=count, max_size=count)


@st.composite
def flat_layout(draw, kind: str) -> dict:
    """MLA-style entries: positional with PP slicing and drafts, or paired by layer id."""
    num_global = draw(st.integers(1, 6))
    num_src = draw(st.integers(min(2, num_global), num_global))
    start = draw(st.integers(0, num_global - num_src + (1 if draw(st.booleans()) else 0)))
    global_lens = draw(
        st.lists(st.sampled_from(ITEM_LENS), min_size=num_global, max_size=num_global)
    )
    state_type = draw(st.sampled_from([None, None, StateType.DSA, StateType.SWA]))
    num_draft = draw(st.sampled_from([0, 0, 1])) if kind != "layer_ids" else 0
    draft_lens = [64] * num_draft
    item_lens = global_lens[start : start + num_src] + draft_lens
    dst_item_lens = global_lens + draft_lens
    layout = {
        "src_data_ptrs": _ptrs(1 << 40, len(item_lens)),
        "dst_data_ptrs": _ptrs(1 << 44, len(dst_item_lens)),
        "item_lens": item_lens,
        "state_type": state_type,
        "force_flat": kind == "force_flat",
    }
    manager = {
        "mla": kind == "mla",
        "hybrid_mla": kind == "hybrid_mla",
        "start_layer": start,
        "num_draft_entries": num_draft,
        "pp_size": 1 if num_src == num_global else 2,
    }
    if kind == "layer_ids":
        dst_ids = draw(st.permutations(list(range(num_global))))
        src_ids = list(range(start, start + num_src))
        if draw(st.integers(0, 9)) == 0:
            dst_ids = dst_ids[1:]  # decode lacks a layer: sglang raises
        layout["src_layer_ids"] = src_ids
        layout["dst_layer_ids"] = dst_ids
        layout["dst_data_ptrs"] = layout["dst_data_ptrs"][: len(dst_ids)]
        dst_item_lens = [global_lens[i] for i in dst_ids]
    layout["dst_item_lens"] = draw(_published_lens(item_lens, dst_item_lens))
    layout["item_lens"] = draw(_elide_some(item_lens))
    return {"call": layout, "manager": manager}


@st.composite
def _elide_some(draw, lens: list[int]) -> list[int]:
    """Often unchanged; sometimes one entry is a zero-length (elided) source."""
    lens = list(lens)
    if lens and draw(st.integers(0, 2)) == 0:
        lens[draw(st.integers(0, len(lens) - 1))] = 0
    return lens


@st.composite
def _published_lens(draw, item_lens: list[int], dst_item_lens: list[int]) -> list[int] | None:
    """None (older peers), the matching decode lens, one elided, or one mismatching."""
    mode = draw(st.sampled_from(["none", "match", "elide", "elide", "mismatch"]))
    if mode == "none" or not dst_item_lens:
        return None
    lens = list(dst_item_lens)
    j = draw(st.integers(0, len(lens) - 1))
    if mode == "elide":
        lens[j] = 0
    elif mode == "mismatch":
        lens[j] += 8
    return lens


@st.composite
def mha_layout(draw) -> dict:
    """Plain MHA: K entries then V entries on both sides, PP stage by start layer."""
    num_global = draw(st.integers(1, 5))
    num_src = draw(st.integers(1, num_global))
    start = draw(st.integers(0, num_global - num_src + (1 if draw(st.booleans()) else 0)))
    k_lens = draw(item_len_lists(num_src))
    v_lens = draw(item_len_lists(num_src))
    call = {
        "src_data_ptrs": _ptrs(1 << 40, 2 * num_src),
        "dst_data_ptrs": _ptrs(1 << 44, 2 * num_global),
        "item_lens": k_lens + v_lens,
        "state_type": None,
        "force_flat": False,
        "dst_item_lens": draw(st.sampled_from([None, k_lens + v_lens])),
    }
    return {"call": call, "manager": {"start_layer": start}}


def swa_single_layout() -> st.SearchStrategy[dict]:
    """Unified SWA: one page-envelope region per side, flat even on an MHA backend."""
    return st.sampled_from(ITEM_LENS).map(
        lambda item_len: {
            "call": {
                "src_data_ptrs": _ptrs(1 << 40, 1),
                "dst_data_ptrs": _ptrs(1 << 44, 1),
                "item_lens": [item_len],
                "state_type": StateType.SWA,
                "force_flat": False,
            },
            "manager": {},
        }
    )


def layout_of(kind: str) -> st.SearchStrategy[dict]:
    if kind == "mha":
        return mha_layout()
    if kind == "swa_single":
        return swa_single_layout()
    return flat_layout(kind)


@st.composite
def pages_and_hisparse(draw, dst_ptrs: list[int]) -> dict:
    """Equal-length page lists (or an empty side) and the HiSparse device destination set."""
    num_pages = draw(st.integers(0, 40))
    src = draw(page_list(num_pages))
    dst = draw(page_list(num_pages))
    call = {"prefill_data_indices": src, "dst_data_indices": dst}
    emptied = draw(st.sampled_from(["none"] * 6 + ["src", "dst", "device"]))
    if emptied == "src":
        call["prefill_data_indices"] = src[:0]
    elif emptied == "dst":
        call["dst_data_indices"] = dst[:0]
    hisparse = draw(st.sampled_from(["off", "off", "set", "set", "indices_only"]))
    if hisparse != "off":
        device = draw(page_list(num_pages))
        call["dst_device_data_indices"] = device[:0] if emptied == "device" else device
    if hisparse == "set":
        mask = draw(st.lists(st.booleans(), min_size=len(dst_ptrs), max_size=len(dst_ptrs)))
        call["dst_device_data_ptrs"] = {p for p, on in zip(dst_ptrs, mask, strict=True) if on}
    return call


@st.composite
def send_scenarios(draw, kind: str) -> SendScenario:
    """A full scenario whose buffers follow layout `kind` (one of LAYOUT_KINDS)."""
    layout = draw(layout_of(kind))
    call = {"mooncake_session_id": SESSION, **layout["call"]}
    call.update(draw(pages_and_hisparse(call["dst_data_ptrs"])))
    call["bootstrap_room"] = draw(st.integers(0, 2**40))
    manager = dict(layout["manager"])
    # The prefill registered every source buffer for its whole span.
    manager["kv_data_ptrs"] = call["src_data_ptrs"]
    manager["kv_data_lens"] = [1 << 32] * len(call["src_data_ptrs"])
    manager["custom_mem_pool"] = draw(st.booleans())
    manager["custom_mem_pool_type"] = draw(st.sampled_from(["NVLINK", "INTRA_NODE_NVLINK"]))
    manager["max_transfer_batch_indices"] = draw(st.sampled_from([0, -1, 1, 3, 8, 1024]))
    if draw(st.booleans()):
        manager["validated_sessions"] = (SESSION,)
    threaded = manager["custom_mem_pool"] and manager["custom_mem_pool_type"] != "INTRA_NODE_NVLINK"
    engine = {"failure_status": draw(st.sampled_from([-1, 3]))}
    if threaded:
        failing_layer = draw(st.sampled_from([None, 0, 1]))
        if failing_layer is not None and failing_layer < len(call["src_data_ptrs"]):
            first = call["src_data_ptrs"][failing_layer]
            engine["fail_src_range"] = range(first, first + (1 << 32))
    else:
        engine["fail_at"] = draw(st.sampled_from([None, None, 0, 1, 2]))
    return SendScenario(manager=manager, call=call, engine=engine, threaded=threaded)

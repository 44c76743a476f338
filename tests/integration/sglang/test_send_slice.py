"""The hooked head-sliced sends make the engine calls sglang's own make, with the same outcome.

sglang's `send_kvcache_slice` and `_send_swa_state_slice` (prefill and decode
with different attention TP) run unhooked and hooked on the same real
`MooncakeKVManager` state, over hypothesis-drawn configurations: KV heads
1-16, head sizes, page sizes 1-64, TP sizes both ways (with replication when
TP > heads), every rank pair, pipeline stages, draft layers paired by layer
id. Through sglang's real wrapper around a recording raw engine (list API or
0.3.14 arrays API): every layer's call with the same descriptors in the same
order (one executor thread, so calls run in submission order), the same
status, the same exception, the same sglang log lines; with a failing layer
(a status or a raise) and several threads, the same status from
`_await_transfer_futures` and no call sglang would not make.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
import types
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sglang_plugin_support import conn, make_manager
from test_layer_calls import CountingPool
from test_send_handoff import ArraysEngine, ListEngine, sglang_wrapper

from gpu_planner.block_pool import BlockPool
from gpu_planner.integration.sglang import (
    counters,
    plugin,
    prefill_routes,
    send_path,
    send_slice,
    staged_send,
)
from gpu_planner.integration.sglang.staging_wire import Capability

ORIGINAL_SLICE = inspect.unwrap(conn.MooncakeKVManager.send_kvcache_slice)
ORIGINAL_SWA = inspect.unwrap(conn.MooncakeKVManager._send_swa_state_slice)
TP_SIZES = (1, 2, 4, 8, 16)
HEAD_LENS = (2, 16, 256)  # bytes of one head of one token
BUFFER_SPAN = 2**32  # fake buffers: one per 4 GiB, so a failing range names one layer
SRC_BASE, DST_BASE = 2**40, 2**46  # where the scenarios' source and destination buffers start
ONE_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1)
FOUR_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=4)
SESSION = "127.0.0.1:12345"
rarely = st.sampled_from([False] * 9 + [True])  # each way sglang raises: 1 in 10


@pytest.fixture(autouse=True)
def no_failing_future_callback():
    """A done callback that raises is only logged by concurrent.futures: fail the test on it."""
    lines = LogLines()
    logging.getLogger("concurrent.futures").addHandler(lines)
    yield
    ONE_THREAD.submit(lambda: None).result()  # every queued call (and its callbacks) has run
    logging.getLogger("concurrent.futures").removeHandler(lines)
    assert lines.lines == []


def test_the_plugin_hooks_both_slice_sends():
    assert conn.MooncakeKVManager.send_kvcache_slice is not ORIGINAL_SLICE
    assert conn.MooncakeKVManager._send_swa_state_slice is not ORIGINAL_SWA


def test_a_changed_signature_is_not_hooked(monkeypatch):
    """register() compares each slice target with the parameters its hook mirrors."""
    parameters = {record.target: record.parameters for record in plugin.hook_records()}
    for target in (plugin.SLICE_TARGET, plugin.SWA_SLICE_TARGET):
        assert plugin.target_mismatch(target, parameters[target]) is None
    fewer = parameters[plugin.SLICE_TARGET][:-1]
    assert "dst_layer_ids" in plugin.target_mismatch(plugin.SLICE_TARGET, fewer)


def buffer_ptrs(base: int, count: int) -> list[int]:
    return [base + index * BUFFER_SPAN for index in range(count)]


@st.composite
def tp_config(draw, lower_prefill_tp: bool = False) -> dict:
    """Heads, TP sizes both ways (`lower_prefill_tp`: prefill TP below decode TP) and a rank
    pair; per-rank head counts as sglang computes them."""
    total_heads = draw(st.integers(1, 16))
    if lower_prefill_tp:
        dst_tp = draw(st.sampled_from(TP_SIZES[1:]))
        src_tp = draw(st.sampled_from([size for size in TP_SIZES if size < dst_tp]))
    else:
        src_tp, dst_tp = draw(st.sampled_from(TP_SIZES)), draw(st.sampled_from(TP_SIZES))
    return {
        "total_heads": total_heads,
        "src_tp": src_tp,
        "dst_tp": dst_tp,
        "engine_rank": draw(st.integers(0, 2 * src_tp - 1)),  # DP ranks past the TP group too
        "dst_tp_rank": draw(st.integers(0, dst_tp - 1)),
        "head_len": draw(st.sampled_from(HEAD_LENS)),
        "page_size": draw(st.integers(1, 64)),
        "src_heads": max(1, total_heads // src_tp),
        "dst_heads": max(1, total_heads // dst_tp),
    }


def pages(draw, num_pages: int) -> np.ndarray:
    values = draw(st.lists(st.integers(0, 4000), min_size=num_pages, max_size=num_pages))
    return np.array(values, dtype=draw(st.sampled_from([np.int32, np.int64])))


@st.composite
def kv_slice_scenarios(draw, lower_prefill_tp: bool = False) -> dict:
    """A `send_kvcache_slice` call and the manager state it reads."""
    config = draw(tp_config(lower_prefill_tp))
    page_size, head_len = config["page_size"], config["head_len"]
    src_item_len = page_size * config["src_heads"] * head_len
    dst_item_len = page_size * config["dst_heads"] * head_len
    if draw(st.booleans()) and draw(st.booleans()):  # a peer whose slot is too small: -1
        dst_item_len = draw(st.integers(0, dst_item_len))
    num_layers = draw(st.integers(1, 3))
    pairing = draw(st.sampled_from(["positional", "pp_stage", "draft_dst", "layer_ids"]))
    start_layer, pp_size, src_layer_ids, dst_layer_ids = 0, 1, [], None
    dst_layers = num_layers
    if pairing == "pp_stage":  # this prefill stage holds decode layers start..start+L
        pp_size = 2
        start_layer = draw(st.integers(0, 3))
        dst_layers = draw(st.integers(num_layers, num_layers + 4))  # may be out of range: raises
    elif pairing == "draft_dst":  # decode has draft layers the prefill lacks
        dst_layers = num_layers + draw(st.integers(1, 2))
    elif pairing == "layer_ids":  # ids: K then V of each layer, draft layers at 1000+
        pp_size = draw(st.sampled_from([1, 2]))
        start_layer = draw(st.integers(0, 2))
        ids = list(range(start_layer, start_layer + num_layers))
        draft = [1000] if draw(st.booleans()) else []
        src_layer_ids = (ids + draft) * 2
        dst_ids = list(range(start_layer + num_layers + draw(st.integers(0, 2)))) + draft
        dst_layer_ids = dst_ids * 2
        dst_layers = len(dst_ids)
        num_layers = len(ids + draft)
    src_item_lens = [src_item_len] * (2 * num_layers)
    if pairing == "layer_ids" and draw(st.booleans()) and draw(st.booleans()):
        src_item_lens[-1] += 1  # sglang refuses mixed item lengths here: -1
    num_pages = draw(st.integers(0, 5))
    kv_args = {
        "kv_data_ptrs": buffer_ptrs(SRC_BASE, 2 * num_layers),
        "kv_data_lens": [BUFFER_SPAN] * (2 * num_layers),
        "kv_item_lens": src_item_lens,
        "kv_layer_ids": src_layer_ids,
        "page_size": page_size,
        "engine_rank": config["engine_rank"],
        "kv_head_num": config["src_heads"],
        # 0: sglang derives it from the per-rank count.
        "total_kv_head_num": draw(st.sampled_from([config["total_heads"], 0])),
    }
    call = {
        "mooncake_session_id": SESSION,
        "prefill_kv_indices": pages(draw, num_pages),
        "dst_kv_ptrs": buffer_ptrs(DST_BASE, 2 * dst_layers),
        "dst_kv_indices": pages(draw, num_pages),
        "dst_tp_rank": config["dst_tp_rank"],
        "dst_attn_tp_size": config["dst_tp"],
        "dst_kv_item_len": dst_item_len,
        "dst_layer_ids": dst_layer_ids,
    }
    manager = {"pp_size": pp_size, "start_layer": start_layer}
    return {"kv_args": kv_args, "call": call, "manager": manager, "tp": config["src_tp"]}


@st.composite
def swa_slice_scenarios(draw) -> dict:
    """A `_send_swa_state_slice` call: SWA K/V entries of per-entry head sizes, page lists."""
    config = draw(tp_config())
    page_size = config["page_size"]
    num_layers = draw(st.integers(1, 3))
    head_lens = draw(st.lists(st.sampled_from(HEAD_LENS), min_size=1, max_size=1)) * num_layers
    head_lens = head_lens + head_lens  # K entries, then V entries of the same layers
    src_item_lens = [page_size * config["src_heads"] * n for n in head_lens]
    dst_item_lens = [page_size * config["dst_heads"] * n for n in head_lens]
    if draw(rarely):  # item lengths that do not split: raises
        dst_item_lens[0] += 1
    num_pages = draw(st.integers(0, 5))
    src_pages = draw(st.lists(st.integers(0, 4000), min_size=num_pages, max_size=num_pages))
    dst_pages = draw(st.lists(st.integers(0, 4000), min_size=num_pages, max_size=num_pages))
    if draw(rarely):
        dst_pages = dst_pages + [7]  # unequal page counts: raises
    kv_args = {
        "page_size": page_size,
        "engine_rank": config["engine_rank"],
        "kv_head_num": config["src_heads"],
        "total_kv_head_num": draw(st.sampled_from([config["total_heads"], 0])),
        "swa_kv_cache_layout": "hnd" if draw(rarely) else "nhd",
        "state_data_ptrs": [buffer_ptrs(SRC_BASE, 2 * num_layers)],
        "state_data_lens": [[BUFFER_SPAN] * (2 * num_layers)],
    }
    call = {
        "req": types.SimpleNamespace(mooncake_session_id=SESSION),
        "prefill_swa_page_indices": src_pages,
        "src_state_data_ptrs": buffer_ptrs(SRC_BASE, 2 * num_layers),
        "src_state_item_lens": src_item_lens,
        "dst_state_data_ptrs": buffer_ptrs(DST_BASE, 2 * num_layers),
        "dst_swa_page_indices": dst_pages,
        "dst_state_item_lens": dst_item_lens,
        "dst_tp_rank": config["dst_tp_rank"],
        "dst_attn_tp_size": config["dst_tp"],
    }
    manager = {"pp_size": 2 if draw(rarely) else 1, "start_layer": 0}
    return {"kv_args": kv_args, "call": call, "manager": manager, "tp": config["src_tp"]}


class LogLines(logging.Handler):
    """sglang's connector log lines during one send."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))


def run(send, scenario: dict, raw, executor, deferred_release: bool = False) -> dict:
    manager = make_manager(
        sglang_wrapper(raw), deferred_release=deferred_release, **scenario["manager"]
    )
    for name, value in scenario["kv_args"].items():
        setattr(manager.kv_args, name, value)
    manager.attn_tp_size = scenario["tp"]
    lines = LogLines()
    # sglang's `warning_once` (transformers') logs a message once per process: once per send here.
    logging.Logger.warning_once.cache_clear()
    conn.logger.addHandler(lines)
    try:
        status, error = send(manager, **scenario["call"], executor=executor), None
    except Exception as exc:  # sglang's own errors must surface unchanged
        status, error = None, (type(exc), str(exc))
    finally:
        conn.logger.removeHandler(lines)
    return {"status": status, "error": error, "calls": raw.calls, "log": lines.lines}


def leaves_a_token_slot(scenario: dict, calls) -> bool:
    """Whether one of sglang's head-sliced descriptors leaves its token slot, on either side.

    Head counts that do not split over the TP sizes make sglang read and write
    across slots; the hooks refuse those sends (test_send_bounds). Descriptor i
    of a layer's call is slot i % page_size of page position i // page_size; a
    slot holds item_len // page_size bytes.
    """
    kv_args, call = scenario["kv_args"], scenario["call"]
    if "dst_kv_item_len" in call:
        pages = (call["prefill_kv_indices"], call["dst_kv_indices"])
        item_lens = (kv_args["kv_item_lens"], [call["dst_kv_item_len"]] * len(call["dst_kv_ptrs"]))
    else:
        pages = (call["prefill_swa_page_indices"], call["dst_swa_page_indices"])
        item_lens = (call["src_state_item_lens"], call["dst_state_item_lens"])
    page_size = kv_args["page_size"]
    for _, *addresses, lens in calls:
        lens = np.array(lens, dtype=np.int64)
        for side, base in enumerate((SRC_BASE, DST_BASE)):
            addrs = np.array(addresses[side], dtype=np.int64)
            buffer = int(addrs[0] - base) // BUFFER_SPAN
            item_len = item_lens[side][buffer]
            position = np.arange(addrs.size)
            slot = (
                base
                + buffer * BUFFER_SPAN
                + np.asarray(pages[side], dtype=np.int64)[position // page_size] * item_len
                + position % page_size * (item_len // page_size)
            )
            inside = (addrs >= slot) & (addrs + lens <= slot + item_len // page_size)
            if not np.all(inside | (lens == 0)):
                return True
    return False


SENDS = {
    "kv": (ORIGINAL_SLICE, lambda: conn.MooncakeKVManager.send_kvcache_slice, kv_slice_scenarios),
    "swa": (
        ORIGINAL_SWA,
        lambda: conn.MooncakeKVManager._send_swa_state_slice,
        swa_slice_scenarios,
    ),
}


@pytest.mark.parametrize("raw_type", [ListEngine, ArraysEngine], ids=["lists", "arrays"])
@pytest.mark.parametrize("kind", SENDS)
def test_hooked_slice_send_makes_sglang_calls(kind: str, raw_type: type):
    check_same_calls(kind, raw_type)


@given(data=st.data())
def check_same_calls(kind: str, raw_type: type, data):
    original, hooked, scenarios = SENDS[kind]
    scenario = data.draw(scenarios())
    expected = run(original, scenario, raw_type(), ONE_THREAD)
    actual = run(hooked(), scenario, raw := raw_type(), ONE_THREAD)
    if leaves_a_token_slot(scenario, expected["calls"]):
        assert (actual["status"], actual["error"], actual["calls"]) == (-1, None, [])
        return
    assert actual == expected
    if actual["calls"]:
        assert raw.argument_types == ({np.ndarray} if raw_type is ArraysEngine else {list})


@pytest.mark.parametrize("kind", SENDS)
def test_a_failing_layer_gives_sglang_status(kind: str):
    check_failing_layer(kind)


@given(
    data=st.data(),
    raw_type=st.sampled_from([ListEngine, ArraysEngine]),
    failure_status=st.sampled_from([-1, 1, 7]),
    raises=st.booleans(),
    deferred_release=st.booleans(),
)
def check_failing_layer(kind, data, raw_type, failure_status, raises, deferred_release):
    original, hooked, scenarios = SENDS[kind]
    scenario = data.draw(scenarios())
    src_ptrs = scenario["kv_args"].get("kv_data_ptrs") or scenario["call"]["src_state_data_ptrs"]
    failing = data.draw(st.sampled_from(src_ptrs))
    engine = {
        "fail_src_range": range(failing, failing + BUFFER_SPAN),
        "failure_status": failure_status,
        "raises": raises,
    }
    expected = run(original, scenario, raw_type(**engine), FOUR_THREADS, deferred_release)
    actual = run(hooked(), scenario, raw_type(**engine), FOUR_THREADS, deferred_release)
    everything = run(original, scenario, raw_type(), ONE_THREAD)["calls"]
    if leaves_a_token_slot(scenario, everything):
        assert (actual["status"], actual["calls"]) == (-1, [])
        return
    assert (actual["status"], actual["error"]) == (expected["status"], expected["error"])
    assert not Counter(map(repr, actual["calls"])) - Counter(map(repr, everything))
    if expected["status"] == 0:  # every call ran (after a failure, sglang cancels queued ones)
        assert Counter(map(repr, actual["calls"])) == Counter(map(repr, expected["calls"]))


def many_layer_scenario(num_layers: int) -> dict:
    """TP2 -> TP4 with `num_layers` layers (K and V: 2 * num_layers engine calls)."""
    return {
        "kv_args": {
            "kv_data_ptrs": buffer_ptrs(SRC_BASE, 2 * num_layers),
            "kv_data_lens": [BUFFER_SPAN] * (2 * num_layers),
            "kv_item_lens": [64] * (2 * num_layers),
            "kv_layer_ids": [],
            "page_size": 4,
            "engine_rank": 0,
            "kv_head_num": 2,
            "total_kv_head_num": 4,
        },
        "call": {
            "mooncake_session_id": SESSION,
            "prefill_kv_indices": np.array([5, 2, 9]),
            "dst_kv_ptrs": buffer_ptrs(DST_BASE, 2 * num_layers),
            "dst_kv_indices": np.array([1, 7, 3]),
            "dst_tp_rank": 1,
            "dst_attn_tp_size": 4,
            "dst_kv_item_len": 32,
        },
        "manager": {},
        "tp": 2,
    }


def test_a_page_list_sglang_cannot_read_runs_the_original():
    """Python lists: sglang's KV slice send fails on `.reshape`; the hook lets it."""
    scenario = many_layer_scenario(1)
    scenario["call"]["prefill_kv_indices"] = [1, 2]
    scenario["call"]["dst_kv_indices"] = [3, 4]
    expected = run(ORIGINAL_SLICE, scenario, ArraysEngine(), ONE_THREAD)
    assert expected["error"][0] is AttributeError
    hooked = conn.MooncakeKVManager.send_kvcache_slice
    assert run(hooked, scenario, ArraysEngine(), ONE_THREAD) == expected


@pytest.mark.parametrize("total_heads", [2, 8])
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 4), (4, 2), (1, 16), (16, 1), (8, 16), (16, 8)])
def test_every_rank_pair_gets_sglang_slices(total_heads: int, src_tp: int, dst_tp: int):
    """Every (prefill rank, decode rank) pair, replication (TP > heads) included."""
    head_len, page_size = 4, 2
    src_heads, dst_heads = max(1, total_heads // src_tp), max(1, total_heads // dst_tp)
    for engine_rank in range(src_tp):
        for dst_tp_rank in range(dst_tp):
            scenario = {
                "kv_args": {
                    "kv_data_ptrs": buffer_ptrs(SRC_BASE, 2),
                    "kv_data_lens": [BUFFER_SPAN] * 2,
                    "kv_item_lens": [page_size * src_heads * head_len] * 2,
                    "kv_layer_ids": [],
                    "page_size": page_size,
                    "engine_rank": engine_rank,
                    "kv_head_num": src_heads,
                    "total_kv_head_num": total_heads,
                },
                "call": {
                    "mooncake_session_id": SESSION,
                    "prefill_kv_indices": np.array([5, 2]),
                    "dst_kv_ptrs": buffer_ptrs(DST_BASE, 2),
                    "dst_kv_indices": np.array([1, 7]),
                    "dst_tp_rank": dst_tp_rank,
                    "dst_attn_tp_size": dst_tp,
                    "dst_kv_item_len": page_size * dst_heads * head_len,
                },
                "manager": {},
                "tp": src_tp,
            }
            expected = run(ORIGINAL_SLICE, scenario, ArraysEngine(), ONE_THREAD)
            hooked = conn.MooncakeKVManager.send_kvcache_slice
            assert run(hooked, scenario, ArraysEngine(), ONE_THREAD) == expected
            assert expected["status"] == 0 and len(expected["calls"]) == 2


class KeepsColumns(ArraysEngine):
    """Keeps views of every call's address columns, as a call Mooncake still runs would."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[np.ndarray] = []

    def batch_transfer_sync_write_arrays(self, session: str, srcs, dsts, lens) -> int:
        self.kept += [srcs, dsts]
        return super().batch_transfer_sync_write_arrays(session, srcs, dsts, lens)


def test_an_address_block_is_lent_until_nothing_views_it(monkeypatch):
    """A block whose addresses anything still views is never handed to the next send."""
    monkeypatch.setattr(send_slice, "ADDRESS_POOL", pool := BlockPool(1 << 30))
    src_ptrs = buffer_ptrs(SRC_BASE, 2)
    raw = KeepsColumns()
    manager = make_manager(sglang_wrapper(raw))
    manager.attn_tp_size = 2
    kv_args = manager.kv_args
    kv_args.kv_data_ptrs, kv_args.kv_item_lens, kv_args.kv_layer_ids = src_ptrs, [64, 64], []
    kv_args.kv_data_lens = [BUFFER_SPAN] * 2
    kv_args.page_size, kv_args.engine_rank, kv_args.kv_head_num = 4, 0, 2
    kv_args.total_kv_head_num = 4
    pages = np.arange(3)
    call = (SESSION, pages, buffer_ptrs(DST_BASE, 2), pages, 1, 4, 32, ONE_THREAD)
    assert conn.MooncakeKVManager.send_kvcache_slice(manager, *call) == 0
    assert raw.kept and pool.retained_bytes == 0  # the engine still views the block
    first_address = raw.kept[0].ctypes.data
    raw.kept.clear()
    returned = pool.retained_bytes
    assert returned > 0  # nothing views the block any more: back in the pool
    assert conn.MooncakeKVManager.send_kvcache_slice(manager, *call) == 0
    assert pool.retained_bytes == 0
    assert raw.kept[0].ctypes.data == first_address  # the same send in that block, not a new one


@pytest.mark.parametrize(("num_layers", "workers"), [(10, 3), (10, 1), (1, 4)])
def test_one_task_sends_every_layer_in_sglangs_order(num_layers: int, workers: int):
    """The hook makes sglang's per-layer calls one after another, from one executor task."""
    scenario = many_layer_scenario(num_layers)
    expected = run(ORIGINAL_SLICE, scenario, ArraysEngine(), ONE_THREAD)
    executor = CountingPool(workers)
    with executor:
        actual = run(conn.MooncakeKVManager.send_kvcache_slice, scenario, ArraysEngine(), executor)
    assert executor.submitted == 1
    assert actual["status"] == expected["status"] == 0
    assert actual["calls"] == expected["calls"]  # one after another: sglang's order exactly


@pytest.mark.parametrize("offered", [True, False], ids=["staging decode", "plain decode"])
def test_a_tp_down_send_that_cannot_be_staged_is_counted(offered: bool):
    """TP 2 -> 1 with one KV head (replicated): each prefill token fills a whole decode token
    slot, no share of it, so the slices cannot be staged. The send goes per token, as sglang's,
    counted once under that path with why: the slices, toward a decode that offers receive
    staging; the decode's offer, toward one that does not. No fallback is counted."""
    routes = prefill_routes.ROUTES
    routes.forget()
    if offered:
        routes.advertised(SESSION, Capability(address=2**50, nbytes=1 << 20))
    scenario = {
        "kv_args": {
            "kv_data_ptrs": buffer_ptrs(SRC_BASE, 2),
            "kv_data_lens": [BUFFER_SPAN] * 2,
            "kv_item_lens": [4 * 16] * 2,  # page 4, one head of 16 bytes
            "kv_layer_ids": [],
            "page_size": 4,
            "engine_rank": 1,
            "kv_head_num": 1,
            "total_kv_head_num": 1,
        },
        "call": {
            "mooncake_session_id": SESSION,
            "prefill_kv_indices": np.array([5, 2, 9]),
            "dst_kv_ptrs": buffer_ptrs(DST_BASE, 2),
            "dst_kv_indices": np.array([1, 7, 3]),
            "dst_tp_rank": 0,
            "dst_attn_tp_size": 1,
            "dst_kv_item_len": 4 * 16,
        },
        "manager": {},
        "tp": 2,
    }
    why = staged_send.NOT_ONE_SHARE if offered else send_path.NO_STAGING_OFFERED
    key = f"{send_path.PER_TOKEN}/{why}"
    expected = run(ORIGINAL_SLICE, scenario, ArraysEngine(), ONE_THREAD)
    before = counters.snapshot()
    try:
        actual = run(
            conn.MooncakeKVManager.send_kvcache_slice, scenario, ArraysEngine(), ONE_THREAD
        )
    finally:
        routes.forget()
    after = counters.snapshot()
    assert actual == expected and expected["status"] == 0 and len(expected["calls"]) == 2
    chosen = {
        path: count - before["paths_chosen"].get(path, 0)
        for path, count in after["paths_chosen"].items()
        if count != before["paths_chosen"].get(path, 0)
    }
    assert chosen == {key: 1}
    assert after["fallbacks"] == before["fallbacks"]

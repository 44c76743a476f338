"""No hooked send reads or writes outside a registered buffer, whatever the decode peer registered.

sglang's sends trust the decode's registration (its item length sets the
head slice, its pages the destination offsets) and never compare a source
descriptor with the prefill's registered buffers; Mooncake does not check
local addresses. Each hook (generic, head-sliced KV, SWA state) refuses such
a send with sglang's failed-send status (-1) before any engine call, and
logs the peer, buffer and field once per peer. Over hypothesis-drawn
registrations the hooks refuse exactly the sends in which one of sglang's
own descriptors would leave the prefill's registered memory, and make
sglang's calls otherwise; then a hostile registration between two real
Mooncake engines moves no byte.
"""

from __future__ import annotations

import concurrent.futures
import logging
import types

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from sglang_plugin_support import ORIGINALS, RecordingEngine, hooked_send, make_manager
from sglang_send_scenarios import LAYOUT_KINDS, SESSION, SendScenario, send_scenarios
from test_send_handoff import ArraysEngine, SpyEngine, sglang_wrapper
from test_send_slice import (
    BUFFER_SPAN,
    DST_BASE,
    ONE_THREAD,
    ORIGINAL_SLICE,
    ORIGINAL_SWA,
    SENDS,
    SRC_BASE,
    buffer_ptrs,
    conn,
    leaves_a_token_slot,
    run,
)

from gpu_planner.inputs import INT64_MAX
from gpu_planner.integration.sglang import bounds, fallback
from tests.integration.mooncake.mooncake_peer import two_sides

EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=4)


@pytest.fixture(autouse=True)
def fresh_refusal_log(monkeypatch):
    """Each test starts with no peer refused yet (the log is once per peer per process)."""
    monkeypatch.setattr(fallback, "_logged_keys", set())


def registered_lens(draw, needed: list[int]) -> list[int]:
    """Per source buffer: the whole span, exactly what it needs, a byte short, or nothing."""
    choice = st.sampled_from(["span"] * 6 + ["exact", "short", "none"])
    lens = {"span": lambda n: BUFFER_SPAN, "exact": lambda n: n, "short": lambda n: n - 1}
    lens["none"] = lambda n: 0
    return [max(lens[draw(choice)](n), 0) for n in needed]


def outside_registration(calls, ptrs: list[int], lens: list[int]) -> bool:
    """Whether a recorded call has a source descriptor outside its buffer's registered bytes."""
    limits = dict(zip(ptrs, lens, strict=True))
    for call in calls:
        srcs, call_lens = np.array(call[1], dtype=np.int64), np.array(call[3], dtype=np.int64)
        base = SRC_BASE + (srcs - SRC_BASE) // BUFFER_SPAN * BUFFER_SPAN
        limit = np.array([limits.get(int(b), 0) for b in base], dtype=np.int64)
        if np.any((call_lens > 0) & (srcs + call_lens > base + limit)):
            return True
    return False


def generic_outcome(send, scenario, kv_data_lens: list[int]) -> dict:
    engine = RecordingEngine()
    manager_state = {**scenario.manager, "kv_data_lens": kv_data_lens}
    manager = make_manager(engine, **manager_state)
    call = {**scenario.call, "executor": EXECUTOR}
    try:
        status, error = send(manager, **call), None
    except Exception as exc:  # sglang's own errors surface unchanged
        status, error = None, (type(exc), str(exc))
    return {"status": status, "error": error, "calls": engine.calls}


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_generic_send_refuses_exactly_what_leaves_registered_memory(kind: str):
    check_generic_bounds(kind)


@given(data=st.data())
def check_generic_bounds(kind: str, data):
    scenario = data.draw(send_scenarios(kind))
    scenario.engine = {}  # no failures: sglang makes every call it would
    src_pages = scenario.call["prefill_data_indices"]
    max_page = int(src_pages.max()) if src_pages.size else 0
    needed = [(max_page + 1) * n for n in scenario.call["item_lens"]]
    lens = registered_lens(data.draw, needed)
    expected = generic_outcome(ORIGINALS["send"], scenario, lens)
    actual = generic_outcome(hooked_send(), scenario, lens)
    if outside_registration(expected["calls"], scenario.manager["kv_data_ptrs"], lens):
        assert (actual["status"], actual["error"], actual["calls"]) == (-1, None, [])
    else:
        assert actual["status"] == expected["status"]
        assert actual["error"] == expected["error"]
        assert sorted(actual["calls"]) == sorted(expected["calls"])


@pytest.mark.parametrize("kind", SENDS)
def test_slice_send_refuses_exactly_what_leaves_registered_memory_or_a_slot(kind: str):
    check_slice_bounds(kind)


@given(data=st.data())
def check_slice_bounds(kind: str, data):
    """Refused (-1, no call) exactly when one of sglang's descriptors would leave the
    prefill's registered memory, or its token slot on either side; else sglang's calls."""
    original, hooked, scenarios = SENDS[kind]
    scenario = data.draw(scenarios())
    kv_args, call = scenario["kv_args"], scenario["call"]
    if kind == "kv":
        ptrs, src_lens = kv_args["kv_data_ptrs"], kv_args["kv_item_lens"]
        src_pages = call["prefill_kv_indices"]
    else:
        ptrs, src_lens = kv_args["state_data_ptrs"][0], call["src_state_item_lens"]
        src_pages = call["prefill_swa_page_indices"]
    max_page = int(np.max(src_pages)) if len(src_pages) else 0
    lens = registered_lens(data.draw, [(max_page + 1) * n for n in src_lens])
    if kind == "kv":
        kv_args["kv_data_lens"] = lens
    else:
        kv_args["state_data_lens"] = [lens]
    expected = run(original, scenario, ArraysEngine(), ONE_THREAD)
    actual = run(hooked(), scenario, ArraysEngine(), ONE_THREAD)
    if outside_registration(expected["calls"], ptrs, lens) or leaves_a_token_slot(
        scenario, expected["calls"]
    ):
        assert (actual["status"], actual["error"], actual["calls"]) == (-1, None, [])
    else:
        assert actual == expected


def hostile_kv_slice(item_len: int = 4 * 2**20) -> dict:
    """Prefill TP2 rank 0 (2 of 4 heads, 16-byte heads, page size 4: 128-byte pages) holds
    50-page (6,400-byte) K and V buffers; a TP4 decode rank 1 registers `item_len` per page."""
    return {
        "kv_args": {
            "kv_data_ptrs": buffer_ptrs(SRC_BASE, 2),
            "kv_data_lens": [6400, 6400],
            "kv_item_lens": [128, 128],
            "kv_layer_ids": [],
            "page_size": 4,
            "engine_rank": 0,
            "kv_head_num": 2,
            "total_kv_head_num": 4,
        },
        "call": {
            "mooncake_session_id": SESSION,
            "prefill_kv_indices": np.array([49, 3], dtype=np.int32),
            "dst_kv_ptrs": buffer_ptrs(DST_BASE, 2),
            "dst_kv_indices": np.array([0, 1], dtype=np.int32),
            "dst_tp_rank": 1,
            "dst_attn_tp_size": 4,
            "dst_kv_item_len": item_len,
        },
        "manager": {},
        "tp": 2,
    }


def refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == fallback.logger.name]


def test_a_decode_registering_4_mib_pages_reads_nothing_past_the_prefill_buffer(caplog):
    """The review's case: sglang reads 2 MiB past a 6,400-byte buffer; the hook sends nothing."""
    scenario = hostile_kv_slice()
    expected = run(ORIGINAL_SLICE, scenario, ArraysEngine(), ONE_THREAD)
    _, srcs, _, lens = expected["calls"][0]
    assert expected["status"] == 0  # sglang's own send: status 0 ...
    assert max(srcs) + lens[0] - SRC_BASE > 2 * 2**20  # ... reading ~2 MiB past its end
    with caplog.at_level(logging.ERROR, logger=fallback.logger.name):
        actual = run(
            conn.MooncakeKVManager.send_kvcache_slice, scenario, ArraysEngine(), ONE_THREAD
        )
    assert (actual["status"], actual["error"], actual["calls"]) == (-1, None, [])
    [message] = refusals(caplog)
    assert SESSION in message
    assert "source buffer 0" in message and "dst_kv_item_len" in message
    assert "1048576 bytes at offset 1048576 of a 32-byte token slot" in message


@pytest.mark.parametrize(
    ("item_len", "reason"),
    [
        (-4096, "head slice of -"),  # a negative length parses from the frame
        (2**70, "dst_kv_item_len"),  # past int64: sglang would build it anyway
        (64, "page 60 of prefill_kv_indices"),  # heads fit; page 60 is past 6,400 bytes
    ],
)
def test_a_hostile_or_oversized_kv_slice_send_is_refused(caplog, item_len, reason):
    scenario = hostile_kv_slice(item_len)
    if item_len == 64:  # a well-formed peer (32 bytes per head slot) and a page past the buffer
        scenario["call"]["prefill_kv_indices"] = np.array([60, 3], dtype=np.int32)
    with caplog.at_level(logging.ERROR, logger=fallback.logger.name):
        actual = run(
            conn.MooncakeKVManager.send_kvcache_slice, scenario, ArraysEngine(), ONE_THREAD
        )
    assert (actual["status"], actual["error"], actual["calls"]) == (-1, None, [])
    [message] = refusals(caplog)
    assert reason in message


def test_negative_destination_pages_are_refused_on_every_hook():
    """A decode page below 0 lands before its buffer (sglang writes there); hooks send nothing."""
    generic = mla_scenario()
    generic.call["dst_data_indices"] = np.array([4, -3], dtype=np.int32)
    expected = generic_outcome(ORIGINALS["send"], generic, [BUFFER_SPAN] * 2)
    assert min(min(call[2]) for call in expected["calls"]) < generic.call["dst_data_ptrs"][0]
    actual = generic_outcome(hooked_send(), generic, [BUFFER_SPAN] * 2)
    assert (actual["status"], actual["calls"]) == (-1, [])

    kv = hostile_kv_slice(64)
    kv["call"]["dst_kv_indices"] = np.array([0, -1], dtype=np.int32)
    assert run(ORIGINAL_SLICE, kv, ArraysEngine(), ONE_THREAD)["calls"]
    hooked_kv = run(conn.MooncakeKVManager.send_kvcache_slice, kv, ArraysEngine(), ONE_THREAD)
    assert (hooked_kv["status"], hooked_kv["calls"]) == (-1, [])

    swa = swa_state_scenario()
    swa["call"]["dst_swa_page_indices"] = [2, -1]
    assert run(ORIGINAL_SWA, swa, ArraysEngine(), ONE_THREAD)["calls"]
    hooked_swa = run(conn.MooncakeKVManager._send_swa_state_slice, swa, ArraysEngine(), ONE_THREAD)
    assert (hooked_swa["status"], hooked_swa["calls"]) == (-1, [])


def mla_scenario() -> SendScenario:
    """An MLA send of two 576-byte-page buffers (registered lengths: `generic_outcome`'s)."""
    ptrs = buffer_ptrs(SRC_BASE, 2)
    return SendScenario(
        manager={"mla": True, "kv_data_ptrs": ptrs},
        call={
            "mooncake_session_id": SESSION,
            "src_data_ptrs": ptrs,
            "dst_data_ptrs": buffer_ptrs(DST_BASE, 2),
            "item_lens": [576, 576],
            "prefill_data_indices": np.array([10, 11], dtype=np.int32),
            "dst_data_indices": np.array([4, 5], dtype=np.int32),
        },
        engine={},
        threaded=False,
    )


def swa_state_scenario() -> dict:
    """SWA state TP2 rank 0 -> TP4 rank 1: one layer's K and V, 8-page registered state buffers."""
    item_lens = [2 * 2 * 16] * 2  # page size 2, 2 local heads of 16 bytes
    return {
        "kv_args": {
            "page_size": 2,
            "engine_rank": 0,
            "kv_head_num": 2,
            "total_kv_head_num": 4,
            "swa_kv_cache_layout": "nhd",
            "state_data_ptrs": [buffer_ptrs(SRC_BASE, 2)],
            "state_data_lens": [[8 * item_lens[0]] * 2],
        },
        "call": {
            "req": type("Req", (), {"mooncake_session_id": SESSION})(),
            "prefill_swa_page_indices": [3, 7],
            "src_state_data_ptrs": buffer_ptrs(SRC_BASE, 2),
            "src_state_item_lens": item_lens,
            "dst_state_data_ptrs": buffer_ptrs(DST_BASE, 2),
            "dst_swa_page_indices": [2, 5],
            "dst_state_item_lens": [2 * 1 * 16] * 2,
            "dst_tp_rank": 1,
            "dst_attn_tp_size": 4,
        },
        "manager": {},
        "tp": 2,
    }


def test_an_swa_state_send_past_the_registered_state_buffer_is_refused(caplog):
    scenario = swa_state_scenario()
    sent = run(conn.MooncakeKVManager._send_swa_state_slice, scenario, ArraysEngine(), ONE_THREAD)
    assert sent["status"] == 0 and len(sent["calls"]) == 2  # pages 3 and 7 of 8: in range
    scenario["call"]["prefill_swa_page_indices"] = [3, 8]
    with caplog.at_level(logging.ERROR, logger=fallback.logger.name):
        actual = run(
            conn.MooncakeKVManager._send_swa_state_slice, scenario, ArraysEngine(), ONE_THREAD
        )
    assert (actual["status"], actual["calls"]) == (-1, [])
    [message] = refusals(caplog)
    assert "page 8 of prefill_swa_page_indices" in message and "512 registered bytes" in message


def test_a_refused_peer_is_logged_once(caplog):
    """Every refused send returns -1; the log names each refused peer once."""
    with caplog.at_level(logging.ERROR, logger=fallback.logger.name):
        for session in (SESSION, SESSION, "127.0.0.1:23456"):
            scenario = hostile_kv_slice()
            scenario["call"]["mooncake_session_id"] = session
            status = run(
                conn.MooncakeKVManager.send_kvcache_slice, scenario, ArraysEngine(), ONE_THREAD
            )["status"]
            assert status == -1
    messages = refusals(caplog)
    assert len(messages) == 2
    assert SESSION in messages[0] and "127.0.0.1:23456" in messages[1]


def test_an_unregistered_source_buffer_is_refused():
    """A source pointer no registration holds (sglang's state lists say nothing of it)."""
    scenario = mla_scenario()
    scenario.manager["kv_data_ptrs"] = scenario.manager["kv_data_ptrs"][:1]
    actual = generic_outcome(hooked_send(), scenario, [BUFFER_SPAN])
    assert (actual["status"], actual["calls"]) == (-1, [])


def test_a_generic_send_is_bounded_by_the_registration_it_meets(caplog):
    """The plan's layout keeps its sources' room per registration: a registration that shrinks
    (or grows back) between two sends of the same buffers bounds the next send."""
    scenario = mla_scenario()  # pages 10 and 11 of 576 bytes: 12 pages' bytes needed
    manager = make_manager(engine := RecordingEngine(), **scenario.manager)
    send = hooked_send()
    outcomes = []
    with caplog.at_level(logging.ERROR, logger=fallback.logger.name):
        for pages in (12, 11, 12):
            manager.kv_args.kv_data_lens = [pages * 576] * 2
            engine.calls.clear()
            status = send(manager, **scenario.call, executor=EXECUTOR)
            outcomes.append((status, len(engine.calls)))
    assert outcomes == [(0, 1), (-1, 0), (0, 1)]
    [message] = refusals(caplog)
    assert "page 11 of prefill_data_indices" in message and "6336 registered bytes" in message


def test_a_source_read_the_planner_refuses_is_refused_whatever_the_message_check_says(
    monkeypatch,
):
    """The planner's scan is what finds a read outside the registration; the check that names
    it runs after. Were that check ever to miss it, the send is still refused, not handed to
    sglang's code (which would read it)."""
    from gpu_planner.integration.sglang import send as generic_send

    monkeypatch.setattr(generic_send, "_check_bounds", lambda *args: None)
    actual = generic_outcome(hooked_send(), mla_scenario(), [11 * 576] * 2)
    assert (actual["status"], actual["error"], actual["calls"]) == (-1, None, [])


def test_a_hostile_registration_moves_no_byte_between_real_engines():
    """Two real Mooncake engines: the decode registers 4 MiB pages for 6,400-byte prefill buffers.

    The decode's buffers are large enough for every write sglang would make, so
    only the check stands between the prefill's memory past its buffers and the peer.
    """
    scenario = hostile_kv_slice()
    with two_sides("push", [6400, 6400], [4 * 2**20 * 2] * 2) as sides:
        manager = make_manager(sglang_wrapper(spy := SpyEngine(sides.local.engine)))
        manager.attn_tp_size = 2
        for name, value in scenario["kv_args"].items():
            setattr(manager.kv_args, name, value)
        manager.kv_args.kv_data_ptrs = sides.local.ptrs
        call = {
            **scenario["call"],
            "mooncake_session_id": sides.peer.session_id,
            "dst_kv_ptrs": sides.peer.ptrs,
        }
        status = conn.MooncakeKVManager.send_kvcache_slice(manager, **call, executor=ONE_THREAD)
        assert status == -1
        assert spy.methods == []
        for actual, before in zip(sides.destination(), sides.destination_initial(), strict=True):
            np.testing.assert_array_equal(actual, before)


def test_each_pointer_list_pairs_with_its_own_length_list():
    """KV lengths one short: the second KV buffer is unregistered, never given a state length.

    sglang registers zip(kv_data_ptrs, kv_data_lens) and each state list with its own
    lengths; concatenating the lists first would credit the second KV buffer with the
    state buffer's length.
    """
    scenario = mla_scenario()
    state_ptr = SRC_BASE + 64 * BUFFER_SPAN
    engine = RecordingEngine()
    manager = make_manager(engine, **scenario.manager, kv_data_lens=[BUFFER_SPAN])
    manager.kv_args.state_data_ptrs = [[state_ptr]]
    manager.kv_args.state_data_lens = [[BUFFER_SPAN]]
    status = hooked_send()(manager, **scenario.call, executor=EXECUTOR)
    assert (status, engine.calls) == (-1, [])
    first, second = scenario.manager["kv_data_ptrs"]
    with pytest.raises(bounds.OutOfRange, match="no registered buffer holds it"):
        bounds.check_sources(manager.kv_args, [second], 0, 576, 0, 576, "pages")
    bounds.check_sources(manager.kv_args, [first, state_ptr], 0, 576, 0, 576, "pages")


REGION = (0x1000, 4096)  # the one registered region of the next tests: [4096, 8192)


def fits_exactly(regions, ptr: int, max_page: int, page_len: int, last: int, read: int) -> bool:
    """Python ints: the read ending at page `max_page`'s `last + read` lies in one region."""
    end = ptr + max_page * page_len + last + read
    return read == 0 or any(
        start <= ptr and end <= min(start + length, INT64_MAX)
        for start, length in regions
        if length > 0
    )


def registration(regions) -> types.SimpleNamespace:
    """A prefill's `kv_args` registering `regions` ((start, length) pairs) as KV buffers."""
    return types.SimpleNamespace(
        kv_data_ptrs=[start for start, _ in regions], kv_data_lens=[n for _, n in regions]
    )


@pytest.mark.parametrize(
    ("ptr", "max_page", "page_len"),
    [
        (REGION[0], 2**62, 4),  # max_page * page_len is 2**64: 0 in int64
        (REGION[0], 2**62 + 1, 2**62),  # far past the room, the product wraps too
        (2**62, 0, 3 * 2**61),  # outside the region: room - read_len wraps positive
        (2**62, 1, 3 * 2**61),  # the same, one page on
    ],
)
def test_a_read_past_the_registered_room_is_refused_at_any_value(ptr, max_page, page_len):
    assert not fits_exactly([REGION], ptr, max_page, page_len, 0, page_len)
    with pytest.raises(bounds.OutOfRange):
        bounds.check_sources(registration([REGION]), [ptr], max_page, page_len, 0, page_len, "p")


LARGE = st.one_of(st.integers(0, 2**13), st.integers(2**61, INT64_MAX), st.integers(0, INT64_MAX))


@example(regions=[REGION], max_page=0, buffers=[(2**62, 3 * 2**61, 0, 3 * 2**61)])
@example(regions=[REGION], max_page=2**62, buffers=[(REGION[0], 4, 0, 4)])
@given(
    regions=st.lists(st.tuples(LARGE, LARGE), min_size=1, max_size=3),
    max_page=LARGE,
    buffers=st.lists(st.tuples(LARGE, LARGE, LARGE, LARGE), min_size=1, max_size=4),
)
def test_check_sources_refuses_exactly_what_does_not_fit(regions, max_page, buffers):
    """Any values in [0, 2**63): refused exactly when one buffer's last read leaves its region."""
    ptrs, page_lens, lasts, reads = (list(column) for column in zip(*buffers, strict=True))
    expected = all(
        fits_exactly(regions, ptr, max_page, page_len, last, read)
        for ptr, page_len, last, read in buffers
    )
    try:
        bounds.check_sources(registration(regions), ptrs, max_page, page_lens, lasts, reads, "p")
    except bounds.OutOfRange:
        fits = False
    else:
        fits = True
    assert fits == expected

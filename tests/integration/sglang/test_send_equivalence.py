"""The hooked `_send_kvcache_generic` makes sglang's engine calls exactly.

Both the original (kept before `load_plugins()`) and the hooked method run on
the same state of a real `MooncakeKVManager` with a recording engine; the
engine calls, their order, the returned status, raised errors and
`conclude_failure` calls must be identical. The custom-memory-pool path submits
one call per layer to a thread pool, so its calls are compared as multisets.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang_plugin_support import (
    ORIGINALS,
    RecordingEngine,
    conn,
    hooked_send,
    make_manager,
    send_outcome,
)
from sglang_send_scenarios import LAYOUT_KINDS, SESSION, SendScenario, send_scenarios

from gpu_planner.integration.sglang import fallback

EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=4)
POSITIONAL = (
    "mooncake_session_id",
    "src_data_ptrs",
    "dst_data_ptrs",
    "item_lens",
    "prefill_data_indices",
    "dst_data_indices",
    "executor",
)


def run_send(send, scenario: SendScenario, positional: bool) -> dict:
    """Call `send` on a fresh manager; everything observable about the call."""
    engine = RecordingEngine(**scenario.engine)
    manager = make_manager(engine, **scenario.manager)
    call = {**scenario.call, "executor": EXECUTOR}
    args = [call.pop(name) for name in POSITIONAL] if positional else []
    return {**send_outcome(send, manager, *args, **call), "calls": engine.calls}


def assert_python_ints(calls) -> None:
    for _, srcs, dsts, lens in calls:
        assert all(type(value) is int for value in srcs + dsts + lens)


def as_multiset(calls) -> Counter:
    return Counter((s, tuple(a), tuple(b), tuple(c)) for s, a, b, c in calls)


def test_plugin_hook_is_installed():
    assert hooked_send() is not ORIGINALS["send"]
    assert hooked_send().__wrapped__ is ORIGINALS["send"]


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_hooked_send_matches_sglang(kind: str):
    check_hooked_send_matches_sglang(kind)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), positional=st.booleans())
def check_hooked_send_matches_sglang(kind: str, data, positional: bool):
    scenario = data.draw(send_scenarios(kind))
    expected = run_send(ORIGINALS["send"], scenario, positional)
    fallbacks = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fallback, "log_fallback_once", lambda *a, **k: fallbacks.append(a))
        actual = run_send(hooked_send(), scenario, positional)
    # Every generated input is planned; where sglang's own code raises (its entry mapping,
    # which the hook runs), the hook hands the call to sglang's code, which raises it.
    assert fallbacks == [] or expected["error"] is not None
    assert actual["error"] == expected["error"]
    assert actual["status"] == expected["status"]
    assert actual["failures"] == expected["failures"]
    assert_python_ints(actual["calls"])
    if not scenario.threaded:
        assert actual["calls"] == expected["calls"]
    elif expected["status"] == 0:
        assert as_multiset(actual["calls"]) == as_multiset(expected["calls"])


def hisparse_mla_call(num_pages: int, max_batch: int) -> tuple[dict, dict]:
    """A DeepSeek-style MLA HiSparse send: 8 layers, the last 3 device-backed."""
    rng = np.random.default_rng(num_pages)
    src = rng.permutation(4 * num_pages)[:num_pages].astype(np.int64)
    dst = np.arange(num_pages, dtype=np.int32) + 10
    device = np.sort(rng.permutation(4 * num_pages)[:num_pages]).astype(np.int32)
    src_ptrs = [(1 << 40) + i * (1 << 32) for i in range(8)]
    dst_ptrs = [(1 << 44) + i * (1 << 32) for i in range(8)]
    call = {
        "mooncake_session_id": SESSION,
        "src_data_ptrs": src_ptrs,
        "dst_data_ptrs": dst_ptrs,
        "item_lens": [656] * 8,
        "prefill_data_indices": src,
        "dst_data_indices": dst,
        "executor": EXECUTOR,
        "dst_device_data_indices": device,
        "dst_device_data_ptrs": set(dst_ptrs[5:]),
    }
    registered = {"kv_data_ptrs": src_ptrs, "kv_data_lens": [1 << 32] * 8}
    return call, {"mla": True, "max_transfer_batch_indices": max_batch, **registered}


@pytest.mark.parametrize("max_batch", [0, 7])
def test_hisparse_device_buffers_use_device_pages(max_batch):
    """A device-backed buffer's descriptors address device pages, never host pages."""
    call, manager_state = hisparse_mla_call(num_pages=50, max_batch=max_batch)
    engine = RecordingEngine()
    assert hooked_send()(make_manager(engine, **manager_state), **call) == 0
    written = {}
    for _, _, dsts, lens in engine.calls:
        for dst, length in zip(dsts, lens, strict=True):
            buffer, offset = divmod(dst - (1 << 44), 1 << 32)
            for page in range(offset // 656, (offset + length) // 656):
                written.setdefault(buffer, []).append(page)
    for buffer in range(8):
        pages = call["dst_device_data_indices"] if buffer >= 5 else call["dst_data_indices"]
        assert sorted(written[buffer]) == sorted(pages.tolist())


def test_unequal_page_lists_raise_like_sglang():
    """sglang rejects unequal non-empty page lists; the hook hands those to it."""
    call, manager_state = hisparse_mla_call(num_pages=12, max_batch=0)
    call["dst_data_indices"] = call["dst_data_indices"][:-1]
    errors = []
    for send in (ORIGINALS["send"], hooked_send()):
        engine = RecordingEngine()
        with pytest.raises(ValueError, match="equal-length") as raised:
            send(make_manager(engine, **manager_state), **call)
        assert engine.calls == []
        errors.append(str(raised.value))
    assert errors[0] == errors[1]


def test_stride_mismatch_concludes_failure_once(caplog):
    """A peer with another stride is failed before any write, logged by sglang's logger."""
    call, manager_state = hisparse_mla_call(num_pages=6, max_batch=0)
    call["dst_item_lens"] = [656] * 7 + [640]
    call["bootstrap_room"] = 77
    engine = RecordingEngine()
    manager = make_manager(engine, **manager_state)
    with caplog.at_level(logging.ERROR, logger=conn.logger.name):
        assert hooked_send()(manager, **call) == -1
    assert engine.calls == []
    [failure] = manager.conclude_failure.calls
    assert failure["bootstrap_room"] == 77
    assert "640" in failure["failure_reason"]
    [record] = [r for r in caplog.records if r.name == conn.logger.name]
    assert record.getMessage() == failure["failure_reason"]

"""What the generic hook keeps per peer layout never outlives the values it was built from.

`entries.transfer_entries` keeps sglang's entries per peer layout, the hook
keeps what it derives from them (destination spaces, planned buffers, their
layout and staged entries), and `bounds.check_sources` keeps each layout's
largest fitting page per registration. Every test sends with the hook and
with sglang's original on the same manager state and compares the engine
calls, after changing what a kept value was built from: a list mutated in
place, a manager field, the prefill's registration, the decode's device
buffers, a manager with a mapping helper of its own. The caches stay bounded.
"""

from __future__ import annotations

import numpy as np
import pytest
from sglang_plugin_support import ORIGINALS, RecordingEngine, conn, hooked_send, make_manager
from suite_support import set_knob

from gpu_planner.integration.sglang import entries, fallback

SESSION = "127.0.0.1:23456"
SRC_BASE, DST_BASE, SPAN = 1 << 40, 1 << 44, 1 << 30
PAGES = (np.array([3, 4, 9, 10, 11], dtype=np.int32), np.array([7, 8, 20, 21, 30], dtype=np.int32))


def ptrs(base: int, count: int) -> list[int]:
    return [base + i * SPAN for i in range(count)]


class Sends:
    """One MLA manager (or `manager_type`'s) and a call's arguments, sent hooked and by sglang."""

    def __init__(self, buffers: int = 4, manager_type: type | None = None, **manager) -> None:
        self.engine = RecordingEngine()
        self.manager = make_manager(
            self.engine, mla=True, kv_data_ptrs=ptrs(SRC_BASE, buffers),
            kv_data_lens=[SPAN] * buffers, **manager,
        )  # fmt: skip
        if manager_type is not None:
            self.manager.__class__ = manager_type
        self.call = {
            "mooncake_session_id": SESSION,
            "src_data_ptrs": ptrs(SRC_BASE, buffers),
            "dst_data_ptrs": ptrs(DST_BASE, buffers),
            "item_lens": [576] * buffers,
            "prefill_data_indices": PAGES[0],
            "dst_data_indices": PAGES[1],
            "executor": None,
        }

    def send(self, send) -> tuple[int, list]:
        before = len(self.engine.calls)
        status = send(self.manager, **self.call)
        return status, self.engine.calls[before:]

    def both(self) -> tuple[tuple[int, list], tuple[int, list]]:
        """(hooked, sglang's): status and engine calls of each, in that order."""
        return self.send(hooked_send()), self.send(ORIGINALS["send"])


@pytest.fixture(autouse=True)
def nothing_kept():
    entries.forget_entries()
    yield
    entries.forget_entries()


@pytest.fixture
def mapped(monkeypatch) -> list[int]:
    """How many times the hook mapped a send's entries (sglang's helpers ran)."""
    count = [0]
    original = entries.mapped_entries

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(entries, "mapped_entries", counting)
    return count


def test_one_peer_layout_is_mapped_once(mapped):
    sends = Sends()
    outcomes = [sends.both() for _ in range(3)]
    assert all(hooked == sglang and hooked[0] == 0 for hooked, sglang in outcomes)
    assert mapped[0] == 1


def test_a_list_changed_in_place_is_mapped_again(mapped):
    sends = Sends()
    hooked, sglang = sends.both()
    sends.call["dst_data_ptrs"][2] += 1 << 36  # the decode re-registered one buffer
    sends.call["item_lens"][1] = 128
    changed, changed_sglang = sends.both()
    assert hooked == sglang and changed == changed_sglang and changed != hooked
    assert mapped[0] == 2


@pytest.mark.parametrize(
    "field, value",
    [("prefill_start_layer", 1), ("num_draft_entries", 1), ("pp_size", 2)],
)
def test_a_changed_manager_field_is_mapped_again(mapped, field, value):
    """A decode with more buffers than the prefill: the PP slice depends on the manager."""
    sends = Sends()
    sends.call["dst_data_ptrs"] = ptrs(DST_BASE, 6)
    first = sends.both()
    owner = sends.manager if field == "pp_size" else sends.manager.kv_args
    setattr(owner, field, value)
    second = sends.both()
    assert first[0] == first[1] and second[0] == second[1]
    assert mapped[0] == 2


def test_a_shrunk_registration_is_refused_and_a_restored_one_sends(monkeypatch):
    monkeypatch.setattr(fallback, "_logged_keys", set())
    sends = Sends()
    assert sends.send(hooked_send()) == sends.send(ORIGINALS["send"])
    lens = sends.manager.kv_args.kv_data_lens
    lens[3] = 11 * 576  # page 11 of buffer 3 no longer registered: sglang would read past it
    assert sends.send(hooked_send()) == (-1, [])
    lens[3] = 12 * 576
    hooked, sglang = sends.both()
    assert hooked == sglang and hooked[0] == 0


def test_changed_device_buffers_change_the_page_space():
    sends = Sends()
    sends.call["dst_device_data_indices"] = np.array([50, 51, 52, 60, 61], dtype=np.int32)
    outcomes = []
    for device in ({DST_BASE + 3 * SPAN}, {DST_BASE + 2 * SPAN, DST_BASE + 3 * SPAN}, None):
        sends.call["dst_device_data_ptrs"] = device
        outcomes.append(sends.both())
    assert all(hooked == sglang for hooked, sglang in outcomes)
    assert len({repr(hooked) for hooked, _ in outcomes}) == 3


def test_a_manager_with_its_own_mapping_helper_is_mapped_every_send(mapped):
    slices = []

    class StageManager(conn.MooncakeKVManager):
        def get_mla_kv_ptrs_with_pp(self, src, dst, state_type=None):
            slices.append(len(dst))
            return src, dst[-len(src) :], len(src)

    sends = Sends(manager_type=StageManager)
    sends.call["dst_data_ptrs"] = ptrs(DST_BASE, 6)
    outcomes = [sends.both() for _ in range(2)]
    assert all(hooked == sglang for hooked, sglang in outcomes)
    assert mapped[0] == 2 and len(slices) == 4  # two hooked sends, two of sglang's


def test_sglangs_stride_check_runs_until_it_passed(monkeypatch):
    checks = []
    original = entries.check_state_strides
    monkeypatch.setattr(entries, "check_state_strides", lambda *a: checks.append(1) or original(*a))
    sends = Sends()
    sends.call.update(dst_item_lens=[576] * 4, bootstrap_room=7)
    assert all(hooked == sglang for hooked, sglang in (sends.both() for _ in range(3)))
    assert len(checks) == 1
    sends.call["dst_item_lens"] = [576, 576, 128, 576]  # a mismatch: every send fails
    for _ in range(2):
        assert sends.send(hooked_send()) == sends.send(ORIGINALS["send"]) == (-1, [])
    assert len(checks) == 3
    assert len(sends.manager.conclude_failure.calls) == 4  # two of the hook's, two of sglang's


def test_what_is_kept_stays_bounded(monkeypatch, mapped):
    """At most GPU_PLANNER_LAYOUT_CACHE_SIZE layouts kept: the least recently sent to go first."""
    set_knob(monkeypatch, "GPU_PLANNER_LAYOUT_CACHE_SIZE", "3")
    sends = Sends()
    layouts = [ptrs(DST_BASE + peer * (1 << 38), 4) for peer in range(8)]
    for peer, dst_ptrs in enumerate(layouts):
        sends.call["dst_data_ptrs"] = list(dst_ptrs)
        sends.manager.kv_args.kv_data_lens = [SPAN - peer] * 4  # a registration per send
        hooked, sglang = sends.both()
        assert hooked == sglang and hooked[0] == 0
    assert mapped[0] == 8
    for dst_ptrs in layouts[-3:]:  # still kept
        sends.call["dst_data_ptrs"] = list(dst_ptrs)
        assert sends.send(hooked_send())[0] == 0
    assert mapped[0] == 8
    sends.call["dst_data_ptrs"] = list(layouts[0])  # dropped: mapped again
    hooked, sglang = sends.both()
    assert hooked == sglang and mapped[0] == 9
    kept = entries.transfer_entries(sends.manager, entries.SendCall(**sends.call))
    assert kept.dst_ptrs == tuple(layouts[0]) and len(kept.derived) == 1
    assert mapped[0] == 9

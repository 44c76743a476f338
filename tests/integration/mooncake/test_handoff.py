"""The hand-off: descriptor arrays to a Mooncake 0.3.14 engine, lists when forced or unsupported.

Two real processes with real 0.3.14 engines move a request in push
(`MooncakeSender`) and pull (`MooncakeReader`), one call per batch or per
buffer, through the arrays path and, on the same engine with
GPU_PLANNER_HANDOFF=lists, the list path; every byte is verified. A
pass-through spy records which Mooncake method took each call and what it
was given.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from mooncake_peer import changed_pages, expected_after, page_request, two_sides
from suite_support import list_batches, set_knob

import gpu_planner as gp
from gpu_planner import settings
from gpu_planner.integration.mooncake import MooncakeReader, MooncakeSender, handoff

ITEM_LEN = 256
POOL_PAGES = 96
NBYTES = [POOL_PAGES * ITEM_LEN] * 4


class SpyEngine:
    """A real Mooncake engine: passes calls through, recording the method and argument types."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list[tuple[str, tuple[type, ...]]] = []

    def _pass(self, method: str, peer: str, *columns) -> int:
        self.calls.append((method, tuple(type(column) for column in columns)))
        for column in columns:
            if isinstance(column, np.ndarray):
                assert column.dtype == np.int64 and column.flags.c_contiguous
        return getattr(self.engine, method)(peer, *columns)

    def batch_transfer_sync_write(self, peer, *columns) -> int:
        return self._pass("batch_transfer_sync_write", peer, *columns)

    def batch_transfer_sync_read(self, peer, *columns) -> int:
        return self._pass("batch_transfer_sync_read", peer, *columns)

    def batch_transfer_sync_write_arrays(self, peer, *columns) -> int:
        return self._pass("batch_transfer_sync_write_arrays", peer, *columns)

    def batch_transfer_sync_read_arrays(self, peer, *columns) -> int:
        return self._pass("batch_transfer_sync_read_arrays", peer, *columns)


def expected_calls(path: str, direction: str, count: int) -> list[tuple[str, tuple[type, ...]]]:
    suffix = "_arrays" if path == handoff.ARRAYS else ""
    column = np.ndarray if path == handoff.ARRAYS else list
    return [(f"batch_transfer_sync_{direction}{suffix}", (column,) * 3)] * count


@pytest.fixture(params=[handoff.ARRAYS, handoff.LISTS])
def path(request, monkeypatch) -> str:
    """The hand-off under test; the list path is forced through the environment variable."""
    if request.param == handoff.LISTS:
        set_knob(monkeypatch, settings.HANDOFF.name, "lists")
    else:
        set_knob(monkeypatch, settings.HANDOFF.name, None)
    return request.param


@pytest.mark.parametrize(
    ("direction", "buffer_workers"), [("push", 0), ("push", 3), ("pull", 0), ("pull", 3)]
)
def test_transfer_moves_every_byte(path: str, direction: str, buffer_workers: int):
    src_pages, dst_pages, _ = page_request(64, POOL_PAGES, seed=2)
    with two_sides(direction, NBYTES, NBYTES) as sides:
        assert hasattr(sides.local.engine, "batch_transfer_sync_write_arrays"), "needs 0.3.14"
        plan = gp.plan_transfer(src_pages, dst_pages, sides.layout(ITEM_LEN), max_batch_pages=7)
        engine = SpyEngine(sides.local.engine)
        with sides.transfer(
            engine, sides.peer.session_id, buffer_workers=buffer_workers
        ) as transfer:
            assert transfer.handoff.form == path
            assert transfer.submit(plan) == plan.total_bytes
        calls = len(list(plan.pieces(per_buffer=bool(buffer_workers))))
        assert calls > 1
        assert engine.calls == expected_calls(path, transfer.direction, calls)
        expected = expected_after(
            sides.destination_initial(), sides.sources(), src_pages, [dst_pages] * 4, ITEM_LEN
        )
        assert changed_pages(sides.destination(), expected, ITEM_LEN) == 0


def test_real_engine_paths(monkeypatch):
    from mooncake.engine import TransferEngine

    set_knob(monkeypatch, settings.HANDOFF.name, None)
    assert handoff.engine_form(TransferEngine, "write") == handoff.ARRAYS
    assert handoff.engine_form(TransferEngine, "read") == handoff.ARRAYS
    set_knob(monkeypatch, settings.HANDOFF.name, "lists")
    assert handoff.engine_form(TransferEngine, "read") == handoff.LISTS


# The hand-off's plan views and argument order, without an engine.


class ListsOnly:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def batch_transfer_sync_write(self, *args) -> int:
        self.calls.append(("write", *args))
        return 0

    def batch_transfer_sync_read(self, *args) -> int:
        self.calls.append(("read", *args))
        return 0


class WithArrays(ListsOnly):
    def batch_transfer_sync_write_arrays(self, *args) -> int:
        self.calls.append(("write_arrays", *args))
        return 0

    def batch_transfer_sync_read_arrays(self, *args) -> int:
        self.calls.append(("read_arrays", *args))
        return 0


def small_plan(max_batch_pages: int = 3) -> gp.TransferPlan:
    pages = np.array([0, 1, 2, 5, 6, 9, 3, 4])
    layout = gp.BufferLayout(
        [1 << 20, 2 << 20, 3 << 20], [5 << 20, 6 << 20, 7 << 20], [64, 64, 128]
    )
    return gp.plan_transfer(pages, pages[::-1].copy(), layout, max_batch_pages=max_batch_pages)


@pytest.mark.parametrize(("engine_type", "path"), [(WithArrays, "arrays"), (ListsOnly, "lists")])
def test_submit_passes_reads_local_side_first(monkeypatch, engine_type, path):
    set_knob(monkeypatch, settings.HANDOFF.name, None)
    plan = small_plan()
    engine = engine_type()
    with MooncakeReader(engine, "peer", batch_timeout_s=None) as reader:
        assert reader.submit(plan) == plan.total_bytes
    method = "read_arrays" if path == "arrays" else "read"
    expected = [(method, "peer", dsts, srcs, lens) for srcs, dsts, lens in list_batches(plan)]
    assert [(m, p, list(a), list(b), list(c)) for m, p, a, b, c in engine.calls] == expected


def test_path_is_logged_once_per_engine_class(monkeypatch, caplog):
    set_knob(monkeypatch, settings.HANDOFF.name, None)

    class FreshEngine(WithArrays):  # a class no other test has logged
        pass

    with caplog.at_level(logging.INFO, logger=handoff.logger.name):
        for _ in range(3):
            MooncakeSender(FreshEngine(), "peer", batch_timeout_s=None).close()
    [record] = [r for r in caplog.records if "FreshEngine" in r.getMessage()]
    assert "write hand-off through arrays" in record.getMessage()

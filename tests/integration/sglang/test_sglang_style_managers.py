"""Managers and engines as sglang's own unit tests build them get sglang's calls.

sglang's upstream tests of the send path build partial managers
(`types.SimpleNamespace`, `object.__new__(MooncakeKVManager)` with only the
attributes one function reads) and compare a `MagicMock` engine's
`call_args_list`. With the plugin loaded each of them must see exactly the
plugin-off run: the hook plans where the manager has what it reads, and
hands the call to sglang's code where it does not, or where `_transfer_data`
is not sglang's own.
"""

from __future__ import annotations

import concurrent.futures
import types
from unittest import mock

import numpy as np
import pytest
from sglang_plugin_support import ORIGINALS, conn
from sglang_send_scenarios import SESSION

from gpu_planner.integration.sglang import counters

SRC_PTRS = [1 << 40, (1 << 40) + (1 << 30)]  # K then V of one layer
DST_PTRS = [1 << 44, (1 << 44) + (1 << 30)]
ITEM_LENS = [256, 256]
PREFILL_PAGES = np.array([0, 1, 2, 7, 9], dtype=np.int32)
DECODE_PAGES = np.array([4, 5, 8, 9, 3], dtype=np.int32)


def magic_engine() -> mock.MagicMock:
    engine = mock.MagicMock()
    engine.batch_transfer_sync.return_value = 0
    return engine


def attributes(engine: object, registered: bool) -> dict:
    """What sglang's `_send_kvcache_generic` reads of a manager (MHA, PP 1, one batch)."""
    kv_args = types.SimpleNamespace(prefill_start_layer=0, prefill_end_layer=None)
    if registered:
        kv_args.kv_data_ptrs, kv_args.kv_data_lens = SRC_PTRS, [1 << 30, 1 << 30]
    return dict(
        kv_args=kv_args,
        engine=engine,
        is_mla_backend=False,
        is_hybrid_mla_backend=False,
        pp_size=1,
        enable_custom_mem_pool=False,
        custom_mem_pool_type=None,
        max_transfer_batch_indices=0,
        state_strides_validated=set(),
    )


def namespace_manager(engine: object, registered: bool) -> types.SimpleNamespace:
    manager = types.SimpleNamespace(**attributes(engine, registered))
    for name in ("_transfer_data", "get_mha_kv_ptrs_with_pp"):
        setattr(manager, name, types.MethodType(getattr(conn.MooncakeKVManager, name), manager))
    return manager


def new_manager(engine: object, registered: bool, cls: type = conn.MooncakeKVManager):
    manager = object.__new__(cls)
    for name, value in attributes(engine, registered).items():
        setattr(manager, name, value)
    return manager


def send(function, manager) -> object:
    return function(
        manager,
        SESSION,
        SRC_PTRS,
        DST_PTRS,
        ITEM_LENS,
        PREFILL_PAGES,
        DECODE_PAGES,
        concurrent.futures.ThreadPoolExecutor(max_workers=1),
    )


def hooked(manager) -> object:
    return send(conn.MooncakeKVManager._send_kvcache_generic, manager)


def plugin_off(manager) -> object:
    return send(ORIGINALS["send"], manager)


BUILDERS = {"SimpleNamespace": namespace_manager, "object.__new__": new_manager}


@pytest.mark.parametrize("registered", [False, True], ids=["kv_args-partial", "kv_args-full"])
@pytest.mark.parametrize("build", BUILDERS.values(), ids=BUILDERS.keys())
def test_a_magicmock_engine_sees_the_plugin_off_calls(build, registered):
    expected_engine, actual_engine = magic_engine(), magic_engine()
    expected = plugin_off(build(expected_engine, registered))
    sends_before = sum(counters.snapshot()["sends"].values())
    actual = hooked(build(actual_engine, registered))
    assert expected_engine.batch_transfer_sync.call_args_list  # the send moved bytes
    assert actual_engine.batch_transfer_sync.call_args_list == (
        expected_engine.batch_transfer_sync.call_args_list
    )
    assert actual == expected == 0
    # A manager with what the hook reads (and sglang's own _transfer_data) is planned.
    planned = sum(counters.snapshot()["sends"].values()) - sends_before
    assert planned == (1 if registered else 0)


def test_a_manager_without_kv_args_gets_sglangs_code_and_sglangs_error():
    expected_manager, actual_manager = (new_manager(magic_engine(), False) for _ in range(2))
    del expected_manager.kv_args, actual_manager.kv_args
    with pytest.raises(AttributeError) as expected:
        plugin_off(expected_manager)
    with pytest.raises(AttributeError) as actual:
        hooked(actual_manager)
    assert str(actual.value) == str(expected.value)  # raised by sglang's own code


class RecordingTransfer(conn.MooncakeKVManager):
    """A subclass (a test, another plugin) that sends its own way."""

    def _transfer_data(self, mooncake_session_id, transfer_blocks):
        self.blocks.append(list(transfer_blocks))
        return 0


@pytest.mark.parametrize("where", ["subclass", "instance"])
def test_an_overridden_transfer_data_gets_every_call(where):
    if where == "subclass":
        expected, actual = (new_manager(magic_engine(), True, RecordingTransfer) for _ in range(2))
    else:
        expected, actual = (new_manager(magic_engine(), True) for _ in range(2))
        for manager in (expected, actual):
            manager._transfer_data = types.MethodType(RecordingTransfer._transfer_data, manager)
    for manager in (expected, actual):
        manager.blocks = []
    assert plugin_off(expected) == hooked(actual) == 0
    assert expected.blocks and actual.blocks == expected.blocks
    assert not actual.engine.batch_transfer_sync.called  # nothing went around the override

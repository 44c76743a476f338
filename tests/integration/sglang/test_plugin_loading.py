"""sglang finds and applies the plugin; it can be disabled; it refuses other signatures."""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from importlib.metadata import entry_points

import numpy as np
import pytest
import sglang
import torch
from sglang_plugin_support import (
    ORIGINALS,
    RecordingEngine,
    common,
    conn,
    make_decode_manager,
    make_manager,
    page_importer,
)
from sglang_send_scenarios import SESSION

from gpu_planner.integration.sglang import fallback as sglang_fallback
from gpu_planner.integration.sglang import page_sizes, receive_staging
from gpu_planner.integration.sglang import plugin as sglang_plugin
from gpu_planner.integration.sglang.page_size_wire import PAGE_SIZE_TAG
from gpu_planner.integration.sglang.plugin import (
    CHUNK_READY_TARGET,
    DECODE_PAGE_SIZES,
    DECODE_STAGING,
    METADATA_MESSAGE_TARGET,
    PAGES_TARGET,
    PARALLEL_INFO_TARGET,
    POP_PREALLOCATED_TARGET,
    PRE_ALLOC_TARGET,
    PREFILL_INFO_TARGET,
    PREFILL_STAGING,
    PREFILL_STATUS_TARGET,
    RECEIVER_CLEAR_TARGET,
    REGISTRATION_INFO_TARGET,
    REGISTRATION_MESSAGE_TARGET,
    SEND_METADATA_TARGET,
    SEND_TARGET,
    SLICE_TARGET,
    STATUS_ENCODE_TARGET,
    STATUS_PARSE_TARGET,
    SWA_SLICE_TARGET,
    TRANSFER_INFO_TARGET,
    UPDATE_STATUS_TARGET,
    WARMUP_TARGET,
)
from gpu_planner.integration.sglang.sglang_sources import SOURCE_FINGERPRINTS

PLUGIN_LOGGER = "gpu_planner.integration.sglang.plugin"
# What registers when the generic send cannot be hooked: everything else, in order, then the
# compile after the KV manager's init. Receive staging: the decode's messages, handlers and room
# lifecycle; the prefill's parsers and its status message.
DECODE_TARGETS = [
    REGISTRATION_MESSAGE_TARGET,
    METADATA_MESSAGE_TARGET,
    CHUNK_READY_TARGET,
    STATUS_PARSE_TARGET,
    PREFILL_STATUS_TARGET,
    UPDATE_STATUS_TARGET,
    RECEIVER_CLEAR_TARGET,
]
PREFILL_TARGETS = [REGISTRATION_INFO_TARGET, TRANSFER_INFO_TARGET, STATUS_ENCODE_TARGET]
# Other page sizes, decode side (with the decode's wire hooks above).
PAGE_SIZE_TARGETS = [PARALLEL_INFO_TARGET, PREFILL_INFO_TARGET, SEND_METADATA_TARGET]
STAGING_TARGETS = DECODE_TARGETS + PREFILL_TARGETS + PAGE_SIZE_TARGETS
TWO_SPACE_TARGETS = [POP_PREALLOCATED_TARGET, PRE_ALLOC_TARGET]
HOOKS_BUT_GENERIC_SEND = [
    SLICE_TARGET,
    SWA_SLICE_TARGET,
    PAGES_TARGET,
    *TWO_SPACE_TARGETS,
    *STAGING_TARGETS,
    WARMUP_TARGET,
]


@pytest.fixture
def fresh_registry(monkeypatch):
    """An empty HookRegistry and fallback log, restored after the test."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(sglang_fallback, "_logged_keys", set())
    return HookRegistry


def test_entry_point_is_installed():
    [plugin] = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "gpu_planner"]
    assert plugin.load() is sglang_plugin.register


def test_load_plugins_hooks_both_targets_for_every_importer():
    from sglang.srt.plugins.hook_registry import HookRegistry

    hooked_send = conn.MooncakeKVManager._send_kvcache_generic
    assert hooked_send is not ORIGINALS["send"]
    assert hooked_send.__wrapped__ is ORIGINALS["send"]
    assert common.kv_to_page_indices.__wrapped__ is ORIGINALS["pages"]
    for target in (SEND_TARGET, PAGES_TARGET):
        assert target in HookRegistry._patched
        sources = {source.plugin_name for _, _, source in HookRegistry._hooks[target]}
        assert sources == {"gpu_planner"}
    # A module that did `from sglang.srt.mem_cache.common import kv_to_page_indices`
    # before load_plugins() calls the hooked function too.
    assert page_importer.kv_to_page_indices is common.kv_to_page_indices


def test_disable_registers_nothing(fresh_registry, monkeypatch, caplog):
    monkeypatch.setenv("GPU_PLANNER_DISABLE", "1")
    with caplog.at_level(logging.INFO, logger=PLUGIN_LOGGER):
        sglang_plugin.register()
    assert dict(fresh_registry._hooks) == {}
    assert "GPU_PLANNER_DISABLE" in caplog.text


def test_register_hooks_both_targets(fresh_registry, monkeypatch):
    monkeypatch.delenv("GPU_PLANNER_DISABLE", raising=False)
    sglang_plugin.register()
    assert sorted(fresh_registry._hooks) == sorted(
        [
            SEND_TARGET,
            SLICE_TARGET,
            SWA_SLICE_TARGET,
            PAGES_TARGET,
            WARMUP_TARGET,
            *TWO_SPACE_TARGETS,
            *STAGING_TARGETS,
        ]
    )


def test_other_signature_is_left_to_sglang(
    fresh_registry, monkeypatch, caplog, send_signature_changed
):
    """A sglang whose send method has other parameters keeps its own code: one WARNING names
    the sglang version and the target."""
    monkeypatch.delenv("GPU_PLANNER_DISABLE", raising=False)
    with caplog.at_level(logging.INFO, logger=PLUGIN_LOGGER):
        sglang_plugin.register()
    assert list(fresh_registry._hooks) == HOOKS_BUT_GENERIC_SEND
    [record] = [r for r in caplog.records if SEND_TARGET in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "bootstrap_room" in record.getMessage()
    assert f"sglang {sglang.__version__} " in record.getMessage()


def test_a_target_with_the_same_parameters_and_other_code_is_left_to_sglang(
    fresh_registry, monkeypatch, caplog
):
    """A matching signature is not enough: a slice send whose code is not sglang 0.5.23's
    (as in sglang 0.5.20) keeps sglang's own code, named in the one WARNING."""
    monkeypatch.delenv("GPU_PLANNER_DISABLE", raising=False)
    monkeypatch.setitem(SOURCE_FINGERPRINTS, SLICE_TARGET, "another release's")
    with caplog.at_level(logging.INFO, logger=PLUGIN_LOGGER):
        sglang_plugin.register()
    assert SLICE_TARGET not in fresh_registry._hooks
    assert SEND_TARGET in fresh_registry._hooks
    [warning] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"{SLICE_TARGET} runs other code than sglang 0.5.23's" in warning.getMessage()
    assert f"1 of {len(sglang_plugin.hook_records())} targets" in warning.getMessage()


def test_missing_target_is_left_to_sglang(fresh_registry, monkeypatch, caplog):
    """A sglang without the send method keeps its own code; the other hook still registers."""
    monkeypatch.delenv("GPU_PLANNER_DISABLE", raising=False)
    missing = SEND_TARGET.replace("_send_kvcache_generic", "_send_kvcache_renamed")
    monkeypatch.setattr(sglang_plugin, "SEND_TARGET", missing)
    with caplog.at_level(logging.INFO, logger=PLUGIN_LOGGER):
        sglang_plugin.register()
    assert list(fresh_registry._hooks) == HOOKS_BUT_GENERIC_SEND
    assert f"{missing} is not in this sglang" in caplog.text


def test_fallback_is_logged_once(fresh_registry, caplog):
    """Inputs sglang itself rejects are handed back to it; the reason is logged once."""
    manager = make_manager(RecordingEngine(), mla=True)
    call = {
        "mooncake_session_id": SESSION,
        "src_data_ptrs": [1 << 40],
        "dst_data_ptrs": [1 << 44],
        "item_lens": [64],
        "prefill_data_indices": np.arange(4),
        "dst_data_indices": np.arange(3),
        "executor": None,
    }
    with caplog.at_level(logging.INFO, logger=PLUGIN_LOGGER):
        for _ in range(2):
            with pytest.raises(ValueError, match="equal-length"):
                conn.MooncakeKVManager._send_kvcache_generic(manager, **call)
    fallbacks = [r for r in caplog.records if "falling back" in r.getMessage()]
    assert len(fallbacks) == 1
    assert "unequal lengths" in fallbacks[0].getMessage()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_kv_to_page_indices_matches_sglang_on_cpu(dtype, page_size):
    kv = torch.randperm(5000, dtype=torch.int64).to(dtype)[:777]
    expected = ORIGINALS["pages"](kv, page_size)
    actual = common.kv_to_page_indices(kv, page_size)
    assert actual.dtype == expected.dtype
    np.testing.assert_array_equal(actual, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path needs CUDA")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_kv_to_page_indices_matches_sglang_on_cuda(dtype, page_size):
    row = torch.randperm(1 << 20, device="cuda").to(dtype).reshape(-1, 1024)
    for kv in (row[3, 5:900], row[:, 7]):  # contiguous and strided slices
        expected = ORIGINALS["pages"](kv, page_size)
        actual = common.kv_to_page_indices(kv, page_size)
        assert isinstance(actual, np.ndarray)
        assert actual.dtype == expected.dtype
        np.testing.assert_array_equal(actual, expected)


class RegisteringEngine:
    """sglang's engine wrapper as a decode's receive staging uses it."""

    def register(self, ptr: int, length: int) -> None:
        pass

    def deregister(self, ptr: int) -> None:
        pass

    def get_session_id(self) -> str:
        return "127.0.0.1:16002"


@pytest.fixture
def decode_hooks_flag():
    """`receive_staging`'s and `page_sizes`' records of the hook sets, restored after the test."""
    yield
    receive_staging.decode_hooks_registered(True)
    page_sizes.decode_hooks_registered(True)
    page_sizes.PREFILL.hooks_registered(True)


@pytest.mark.parametrize("skipped", STAGING_TARGETS)
def test_a_staging_hook_that_cannot_register_keeps_its_whole_set_out(
    fresh_registry, monkeypatch, caplog, decode_hooks_flag, skipped
):
    """One hook of a receive-staging side that this sglang would not take (a changed
    signature): none of that side registers, one WARNING names it, it is counted, and the
    other side and every send hook stay. Without the decode's set, a decode neither
    advertises nor lends."""
    from gpu_planner.integration.sglang import counters

    records = sglang_plugin.hook_records
    monkeypatch.setattr(
        sglang_plugin,
        "hook_records",
        lambda: [
            dataclasses.replace(r, parameters=r.parameters[:-1]) if r.target == skipped else r
            for r in records()
        ],
    )
    group, out = (
        (DECODE_STAGING, DECODE_TARGETS)
        if skipped in DECODE_TARGETS
        else (DECODE_PAGE_SIZES, PAGE_SIZE_TARGETS)
        if skipped in PAGE_SIZE_TARGETS
        else (PREFILL_STAGING, PREFILL_TARGETS)
    )
    key = f"hooks not registered: {group}"
    before = counters.snapshot()["fallbacks"].get(key, 0)
    with caplog.at_level(logging.INFO, logger=PLUGIN_LOGGER):
        sglang_plugin.register()
    registered = set(fresh_registry._hooks)
    assert registered == set(
        [SEND_TARGET, SLICE_TARGET, SWA_SLICE_TARGET, PAGES_TARGET, WARMUP_TARGET]
        + TWO_SPACE_TARGETS
        + [target for target in STAGING_TARGETS if target not in out]
    )
    [warning] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.levelno == logging.WARNING
    assert f"no {group} hook registers" in warning.getMessage()
    assert skipped in warning.getMessage()
    assert counters.snapshot()["fallbacks"][key] == before + 1
    decode = make_decode_manager(RegisteringEngine(), [1 << 30], [4096], [256], 4)
    frames = [b"sglang's registration"]
    hooked = receive_staging.registration_message_hook(lambda _: frames, decode)
    assert (hooked is frames) == (group == DECODE_STAGING)  # advertised only with every hook
    # The decode serves other page sizes (and says its own) only with both decode sets.
    assert (PAGE_SIZE_TAG in hooked) == (group == PREFILL_STAGING)
    receive_staging.REGIONS.release(decode)

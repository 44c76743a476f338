"""Knobs are parsed once, when sglang loads the plugin; none at import, none per send.

An invalid value of any knob logs one error naming it and registers no hook,
so the server starts and runs sglang's own code; a knob that names a hand-off
the engine lacks is a counted fallback per send, never an exception.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sglang_plugin_support import ORIGINALS, RecordingEngine, conn, make_manager
from sglang_send_scenarios import SESSION
from suite_support import set_knob
from test_plugin_loading import PLUGIN_LOGGER, fresh_registry  # noqa: F401 (a fixture)

from gpu_planner import settings
from gpu_planner.integration.sglang import counters
from gpu_planner.integration.sglang import plugin as sglang_plugin

ROOT = Path(__file__).parents[3]
SOURCES = [ROOT / "gpu_planner", ROOT / "integration", ROOT / "kernels"]

# Values sessions and users wrote that the parsers refuse.
MALFORMED = [
    ("GPU_PLANNER_HANDOFF", "array"),
    ("GPU_PLANNER_GATHER_STAGING_BYTES", "128MiB"),
    ("GPU_PLANNER_GATHER_STAGING_BYTES", "-5"),
    ("GPU_PLANNER_BATCH_TIMEOUT_S", "0"),
    ("GPU_PLANNER_BATCH_TIMEOUT_S", "nan"),
    ("GPU_PLANNER_BATCH_TIMEOUT_S", "60s"),
    ("GPU_PLANNER_MAX_ABANDONED_CALLS", "0"),
    ("GPU_PLANNER_LAYOUT_CACHE_SIZE", "many"),
]


@pytest.mark.parametrize(("name", "value"), MALFORMED)
def test_an_invalid_knob_registers_no_hook_and_names_itself_once(
    fresh_registry,  # noqa: F811
    monkeypatch,
    caplog,
    name,
    value,
):
    set_knob(monkeypatch, name, value)
    with caplog.at_level(logging.INFO, logger=PLUGIN_LOGGER):
        sglang_plugin.register()
    assert dict(fresh_registry._hooks) == {}
    [error] = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert f"{name}={value!r}" in error.getMessage()
    assert "registering no hook" in error.getMessage()


def test_every_invalid_knob_is_named_in_the_one_error(monkeypatch):
    for name, value in MALFORMED[:3:2] + MALFORMED[3:4]:
        set_knob(monkeypatch, name, value)
    with pytest.raises(settings.SettingError) as raised:
        settings.load()
    for name, value in MALFORMED[:3:2] + MALFORMED[3:4]:
        assert f"{name}={value!r}" in str(raised.value)


def test_loaded_values_hold_after_the_environment_changes(monkeypatch):
    set_knob(monkeypatch, "GPU_PLANNER_GATHER_STAGING_BYTES", "4096")
    settings.load()
    monkeypatch.setenv("GPU_PLANNER_GATHER_STAGING_BYTES", "8192")
    monkeypatch.setenv("GPU_PLANNER_HANDOFF", "nonsense")
    assert settings.loaded(settings.GATHER_STAGING_BYTES) == 4096
    assert settings.loaded(settings.HANDOFF) == "auto"


def test_every_module_imports_with_every_knob_malformed():
    """No knob is read at import: the plugin's modules import whatever the environment says."""
    environment = {name: value for name, value in MALFORMED}
    modules = ["gpu_planner"] + [
        f"gpu_planner.integration.{name}"
        for name in (
            "mooncake.transfer",
            "mooncake.handoff",
            "sglang.plugin",
            "sglang.send",
            "sglang.send_slice",
            "sglang.gathered",
            "sglang.bounds",
            "sglang.pages",
            "info",
        )
    ]
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\n"
    result = subprocess.run(
        [sys.executable, "-c", code, *modules],
        env={**_base_environment(), **environment},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]


def _base_environment() -> dict[str, str]:
    import os

    return {key: value for key, value in os.environ.items() if not key.startswith("GPU_PLANNER")}


def _setting_reads() -> list[tuple[str, str, str]]:
    """(file, reader, setting) for every `settings.get`/`settings.loaded` call in the sources."""
    reads = []
    for source in SOURCES:
        for path in source.rglob("*.py"):
            if path.name == "settings.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "settings"
                    and node.func.attr in ("get", "loaded", "sized_cache")
                    and node.args
                    and isinstance(node.args[0], ast.Attribute)
                ):
                    reads.append((str(path.relative_to(ROOT)), node.func.attr, node.args[0].attr))
    return reads


def test_each_knob_is_read_when_docs_settings_md_says():
    """LOADED knobs only through `loaded` (parsed at plugin load), AT_CONSTRUCTION through `get`."""
    reads = _setting_reads()
    assert reads, "no setting read found: the scan is broken"
    when = {name: getattr(settings, name).read for _, _, name in reads}
    for path, reader, name in reads:
        expected = ("get",) if when[name] == settings.AT_CONSTRUCTION else ("loaded", "sized_cache")
        assert reader in expected, f"{path}: settings.{reader}({name}) but it is read {when[name]}"
    docs = (ROOT / "docs" / "settings.md").read_text()
    for setting in settings.SETTINGS:
        assert f"| {setting.read} |" in docs.split(f"`{setting.name}`")[1].split("\n")[0]


def mla_send(send) -> tuple[int, list]:
    """One MLA send of three pages through `send`: its status and the engine's calls."""
    engine = RecordingEngine()  # sglang's list API only
    manager = make_manager(engine, mla=True, kv_data_ptrs=[1 << 40], kv_data_lens=[1 << 30])
    pages = np.array([0, 1, 5], dtype=np.int32), np.array([3, 4, 9], dtype=np.int32)
    status = send(manager, SESSION, [1 << 40], [1 << 44], [64], *pages, None)
    return status, engine.calls


def test_arrays_asked_of_a_lists_engine_is_a_counted_fallback_per_send(monkeypatch):
    """GPU_PLANNER_HANDOFF=arrays with an engine without the arrays API: sglang's own send."""
    set_knob(monkeypatch, "GPU_PLANNER_HANDOFF", "arrays")
    before = counters.snapshot()["fallbacks"].get("handoff unavailable", 0)
    outcomes = [mla_send(conn.MooncakeKVManager._send_kvcache_generic) for _ in range(2)]
    expected = mla_send(ORIGINALS["send"])
    assert expected[1]  # the send moves bytes
    assert outcomes == [expected] * 2
    assert counters.snapshot()["fallbacks"]["handoff unavailable"] == before + 2


def test_a_failed_compile_leaves_its_hook_and_stops_nothing(fresh_registry, monkeypatch):  # noqa: F811
    """Compiling ahead of the first request is an optimisation: its failure (after the KV manager
    is built) is logged and counted, never raised."""

    def broken_compile() -> None:
        raise RuntimeError("numba could not compile")

    records = sglang_plugin.hook_records()
    monkeypatch.setattr(
        sglang_plugin,
        "hook_records",
        lambda: [dataclasses.replace(record, compile=broken_compile) for record in records],
    )
    before = counters.snapshot()["fallbacks"].get("compile", 0)
    sglang_plugin.register()
    assert sorted(fresh_registry._hooks) == sorted(
        {record.target for record in records} | {sglang_plugin.WARMUP_TARGET}
    )
    assert sglang_plugin.compile_after_manager_init(None, object()) is None
    assert counters.snapshot()["fallbacks"]["compile"] == before + 1  # one compile, once

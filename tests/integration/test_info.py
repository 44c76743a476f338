"""`gpu-planner info` reports this environment: versions, plugin hooks, backends, hand-off."""

from __future__ import annotations

import importlib.metadata

import pytest

from gpu_planner import settings
from gpu_planner.cli import main
from gpu_planner.integration import info
from gpu_planner.integration.sglang.plugin import PAGES_TARGET, SEND_TARGET


def run_info(capsys) -> dict[str, str]:
    """`gpu-planner info`'s `name  value` lines as a dict (headings dropped)."""
    assert main(["info"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  "):
            name, value = line.strip().split("  ", 1)
            rows[name] = value.strip()
    return rows


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    monkeypatch.delenv(settings.HANDOFF.name, raising=False)
    monkeypatch.delenv("GPU_PLANNER_DISABLE", raising=False)


def test_info_reports_this_environment(capsys):
    rows = run_info(capsys)
    assert rows["gpu_planner"] == importlib.metadata.version("gpu-planner")
    assert rows["sglang"] == "0.5.23"
    assert rows["torch"] == importlib.metadata.version("torch")
    assert rows["Numba"] == importlib.metadata.version("numba")
    assert rows["Mooncake"] == "mooncake-transfer-engine-cuda13 0.3.14"
    assert rows["plugin"] == "would load, every hook registers"
    assert rows[SEND_TARGET] == rows[PAGES_TARGET] == "hooked"
    assert rows["NumPy array"] == rows["CPU tensor"] == "cpu"
    assert rows["CUDA tensor"].startswith("triton")
    assert rows["write hand-off"] == rows["read hand-off"] == "arrays"


def test_info_shows_forced_lists_and_a_disabled_plugin(capsys, monkeypatch):
    monkeypatch.setenv(settings.HANDOFF.name, "lists")
    monkeypatch.setenv("GPU_PLANNER_DISABLE", "1")
    rows = run_info(capsys)
    assert rows["write hand-off"] == f"lists ({settings.HANDOFF.name}=lists)"
    assert "GPU_PLANNER_DISABLE" in rows["plugin"]


def test_info_names_a_target_whose_signature_changed(capsys, send_signature_changed):
    rows = run_info(capsys)
    assert rows[SEND_TARGET].startswith("not hooked: ")
    assert "bootstrap_room" in rows[SEND_TARGET]
    assert rows[PAGES_TARGET] == "hooked"


def test_two_mooncake_builds_are_flagged(monkeypatch):
    builds = {"mooncake": ["mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13"]}
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: builds)
    assert "several builds" in dict(info.versions())["Mooncake"]


def test_info_says_whether_receive_staging_is_on_and_its_size(capsys, monkeypatch):
    monkeypatch.setenv(settings.RECEIVE_STAGING_BYTES.name, str(8 << 20))
    monkeypatch.setenv(settings.STAGING_MIN_DESCRIPTORS.name, "100")
    monkeypatch.setenv(settings.STAGING_MAX_MEAN_BYTES.name, "4096")
    rows = run_info(capsys)
    assert rows["decode region"] == "on: 8388608 bytes (8 MiB) per decode KV manager"
    assert ">= 100 descriptors of <= 4096 bytes on average" in rows["prefill stages"]
    monkeypatch.setenv(settings.RECEIVE_STAGING_BYTES.name, "0")
    settings.forget_loaded()
    rows = run_info(capsys)
    assert rows["decode region"] == f"off ({settings.RECEIVE_STAGING_BYTES.name}=0)"

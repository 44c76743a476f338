"""Every knob parses one way, and a bad value names its variable and what it accepts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpu_planner import pinned_copies, settings


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", False),
        ("1", True),
        ("TRUE", True),
        (" yes ", True),
        ("on", True),
        ("0", False),
        ("off", False),
        ("No", False),
    ],
)
def test_flags(monkeypatch, text, expected):
    monkeypatch.setenv("GPU_PLANNER_DISABLE", text)
    assert settings.get(settings.DISABLE) is expected


@pytest.mark.parametrize(
    ("setting", "text"),
    [
        (settings.DISABLE, "maybe"),
        (settings.HANDOFF, "tuples"),
        (settings.STAGING_RETAINED_BYTES, "-1"),
        (settings.STAGING_RETAINED_BYTES, "64M"),
        (settings.LAYOUT_CACHE_SIZE, "0"),
        (settings.BATCH_TIMEOUT_S, "inf"),
        (settings.BATCH_TIMEOUT_S, "nan"),
        (settings.BATCH_TIMEOUT_S, "0"),
        (settings.BATCH_TIMEOUT_S, "1e10"),
        *(
            (size, str(value))
            for size in (settings.RECEIVE_STAGING_BYTES, settings.GATHER_STAGING_BYTES)
            for value in (2**47 + 1, 2**63, 2**64, 10**30)  # past any address space
        ),
    ],
)
def test_bad_values_name_the_variable(monkeypatch, setting, text):
    monkeypatch.setenv(setting.name, text)
    with pytest.raises(
        settings.SettingError, match=f"{setting.name}=.*expected {re.escape(setting.accepts)}"
    ):
        settings.get(setting)


def test_values_and_defaults(monkeypatch):
    assert [settings.get(setting) for setting in settings.SETTINGS] == [
        setting.default for setting in settings.SETTINGS
    ]
    monkeypatch.setenv("GPU_PLANNER_HANDOFF", "Lists")
    monkeypatch.setenv("GPU_PLANNER_BATCH_TIMEOUT_S", "none")
    monkeypatch.setenv("GPU_PLANNER_STAGING_RETAINED_BYTES", "0x1000")
    assert settings.get(settings.HANDOFF) == "lists"
    assert settings.get(settings.BATCH_TIMEOUT_S) is None
    assert pinned_copies.pinned_pool().max_retained_bytes == 4096


def test_the_docs_table_is_the_modules():
    docs = (Path(__file__).parents[1] / "docs" / "settings.md").read_text()
    assert settings.markdown_table() in docs
    assert len(settings.SETTINGS) == len({setting.name for setting in settings.SETTINGS})


@pytest.mark.parametrize("size", [settings.RECEIVE_STAGING_BYTES, settings.GATHER_STAGING_BYTES])
def test_a_staging_size_too_large_to_allocate_is_refused_at_load(monkeypatch, size):
    """At load, not at the first allocation: the plugin then registers no hook (one error)
    instead of running with staging silently off, retried on every registration."""
    monkeypatch.setenv(size.name, str(2**63))
    with pytest.raises(settings.SettingError, match=size.name):
        settings.load()
    monkeypatch.setenv(size.name, str(settings.MAX_STAGING_BYTES))
    settings.load()
    assert settings.loaded(size) == 2**47


def test_loaded_generation_is_none_while_nothing_is_loaded():
    """What a caller built at one generation stands while `loaded_generation` returns it:
    a load moves it, and `forget_loaded` makes it None until the next load."""
    settings.load()
    first = settings.loaded_generation()
    assert first == settings.generation()
    settings.forget_loaded()
    assert settings.loaded_generation() is None
    settings.loaded(settings.HANDOFF)  # loads again
    assert settings.loaded_generation() == settings.generation() == first + 1

"""Every environment knob and numeric cap of gpu_planner, in one place, parsed one way.

Each `Setting` names its environment variable, its default and what it
bounds; `get(setting)` reads the variable (unset or empty: the default) and
raises a `SettingError` naming the variable and what it accepts. The caps
that size caches are read once, when their module loads. docs/settings.md
documents each one (`markdown_table`; a test keeps the two in step). Mooncake's
own variables (`MC_*`) are not ours: `integration/mooncake/engine.py` sets the few
defaults the project starts engines with.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

Value = TypeVar("Value")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingError(ValueError):
    """An environment variable of gpu_planner holds a value it does not accept."""


@dataclass(frozen=True)
class Setting(Generic[Value]):
    """One knob: its environment variable, default, parser and meaning."""

    name: str
    default: Value
    parse: Callable[[str], Value]
    accepts: str  # what the parser accepts, for errors and docs
    meaning: str


def get(setting: Setting[Value]) -> Value:
    """`setting`'s value from the environment (unset or blank: its default)."""
    text = os.environ.get(setting.name, "").strip()
    if not text:
        return setting.default
    try:
        return setting.parse(text)
    except ValueError:
        raise SettingError(
            f"{setting.name}={text!r}: expected {setting.accepts}; {setting.meaning}"
        ) from None


def _flag(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise ValueError(text)
        return text.lower()

    return parse


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text, 0)
        if value < minimum:
            raise ValueError(text)
        return value

    return parse


def _seconds(text: str) -> float | None:
    """Seconds in (0, threading.TIMEOUT_MAX], or `none` for no bound."""
    if text.lower() == "none":
        return None
    value = float(text)
    if not (math.isfinite(value) and 0 < value <= threading.TIMEOUT_MAX):
        raise ValueError(text)
    return value


DISABLE = Setting(
    "GPU_PLANNER_DISABLE",
    False,
    _flag,
    "one of 1/true/yes/on or 0/false/no/off",
    "the sglang plugin registers no hook: sglang plans its own transfers",
)
HANDOFF = Setting(
    "GPU_PLANNER_HANDOFF",
    "auto",
    _choice("auto", "arrays", "lists"),
    "auto, arrays or lists",
    "how descriptors reach Mooncake: arrays where the engine takes them (auto), or "
    "always Python lists (Mooncake <= 0.3.13's form); arrays refuses an engine without them",
)
STAGING_RETAINED_BYTES = Setting(
    "GPU_PLANNER_STAGING_RETAINED_BYTES",
    64 << 20,
    _count(0),
    "an integer >= 0",
    "pinned staging bytes kept free for later copies (past it the least recently used "
    "blocks are unpinned)",
)
ADDRESS_RETAINED_BYTES = Setting(
    "GPU_PLANNER_ADDRESS_RETAINED_BYTES",
    1 << 30,
    _count(0),
    "an integer >= 0",
    "bytes of head-sliced sends' descriptor blocks kept free for later sends",
)
LAYOUT_CACHE_SIZE = Setting(
    "GPU_PLANNER_LAYOUT_CACHE_SIZE",
    256,
    _count(1),
    "an integer >= 1",
    "peer buffer layouts each sglang hook keeps built (read when the plugin loads)",
)
GATHER_STAGING_BYTES = Setting(
    "GPU_PLANNER_GATHER_STAGING_BYTES",
    128 << 20,
    _count(0),
    "an integer >= 0",
    "bytes of staging, registered with Mooncake once per KV manager, that head-sliced sends "
    "from a lower prefill TP gather into (two halves: one gathered while the other is sent); "
    "0 sends per-token descriptors",
)
BATCH_TIMEOUT_S = Setting(
    "GPU_PLANNER_BATCH_TIMEOUT_S",
    60.0,
    _seconds,
    "seconds in (0, threading.TIMEOUT_MAX], or none",
    "default bound on one batch of MooncakeSender/MooncakeReader",
)

MAX_ABANDONED_CALLS = Setting(
    "GPU_PLANNER_MAX_ABANDONED_CALLS",
    16,
    _count(1),
    "an integer >= 1",
    "default cap on engine calls of timed-out batches still running per "
    "MooncakeSender/MooncakeReader; at the cap batches are refused until they end",
)

SETTINGS: tuple[Setting, ...] = (
    DISABLE,
    HANDOFF,
    STAGING_RETAINED_BYTES,
    ADDRESS_RETAINED_BYTES,
    LAYOUT_CACHE_SIZE,
    GATHER_STAGING_BYTES,
    BATCH_TIMEOUT_S,
    MAX_ABANDONED_CALLS,
)


def markdown_table() -> str:
    """docs/settings.md's table: every setting, its default, what it accepts and bounds."""
    rows = [
        "| variable | default | accepts | what it does |",
        "| --- | --- | --- | --- |",
    ]
    for setting in SETTINGS:
        default = setting.default
        default = (
            "none" if default is None else int(default) if isinstance(default, bool) else default
        )
        rows.append(f"| `{setting.name}` | `{default}` | {setting.accepts} | {setting.meaning} |")
    return "\n".join(rows) + "\n"

"""Every environment knob and numeric cap of gpu_planner, in one place, parsed one way.

Each `Setting` names its environment variable, its default, what it bounds
and when it is read. Unset or empty means the default; a value the parser
does not accept is a `SettingError` naming the variable and what it accepts.

Two moments of reading, never import time and never per send:

- `LOADED` knobs are parsed once per process by `load()`: the sglang plugin
  calls it when sglang loads it (an invalid value of any knob then registers
  no hook), any other process at its first `loaded(setting)`; from then on
  `loaded` returns those values, whatever the environment says later.
- `AT_CONSTRUCTION` knobs are the defaults of an object's arguments:
  `get(setting)` reads the variable when the object is built.

docs/settings.md documents each one (`markdown_table`; a test keeps the two
in step). Mooncake's own variables (`MC_*`) are not ours:
`integration/mooncake/engine.py` sets the few defaults the project starts
engines with.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

Value = TypeVar("Value")
Function = TypeVar("Function", bound=Callable[..., Any])

LOADED = "once per process, when the sglang plugin loads (elsewhere at first use)"
AT_CONSTRUCTION = "when a MooncakeSender or MooncakeReader is built without the argument"

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
    read: str = LOADED  # LOADED or AT_CONSTRUCTION


def get(setting: Setting[Value], environ: Mapping[str, str] | None = None) -> Value:
    """`setting`'s value in the environment now (unset or blank: its default).

    For `AT_CONSTRUCTION` knobs, read by the constructor they default; `LOADED`
    knobs are read through `loaded`.
    """
    text = (os.environ if environ is None else environ).get(setting.name, "").strip()
    if not text:
        return setting.default
    try:
        return setting.parse(text)
    except ValueError:
        raise SettingError(
            f"{setting.name}={text!r}: expected {setting.accepts}; {setting.meaning}"
        ) from None


_loaded: dict[str, Any] | None = None
_generation = 0  # how many times `load` succeeded: sized caches rebuild when it moves
_explicit: frozenset[str] = frozenset()  # the knobs `load` found set (not blank)
_load_lock = threading.Lock()


def load(environ: Mapping[str, str] | None = None) -> None:
    """Parse every knob now; `loaded` returns these values from then on.

    Raises one `SettingError` naming every variable whose value is not
    accepted (and then keeps the values loaded before, if any).
    """
    global _loaded, _generation, _explicit
    values: dict[str, Any] = {}
    errors: list[str] = []
    for setting in SETTINGS:
        try:
            values[setting.name] = get(setting, environ)
        except SettingError as error:
            errors.append(str(error))
    if errors:
        raise SettingError("; ".join(errors))
    given = os.environ if environ is None else environ
    explicit_names = frozenset(name for name in values if given.get(name, "").strip())
    with _load_lock:
        _loaded = values
        _explicit = explicit_names
        _generation += 1


def loaded(setting: Setting[Value]) -> Value:
    """`setting`'s value as `load` parsed it (loading first if nothing was loaded yet)."""
    if _loaded is None:
        load()
    assert _loaded is not None
    return _loaded[setting.name]


def explicit(setting: Setting) -> bool:
    """Whether `load` found `setting` set (not blank) rather than taking its default.

    A value equal to the default, set on purpose, counts as set: where a knob
    overrides what gpu_planner would otherwise decide, setting it is the ask.
    """
    if _loaded is None:
        load()
    return setting.name in _explicit


def generation() -> int:
    """How many times `load` succeeded: what is built from loaded values rebuilds when it moves."""
    return _generation


def loaded_generation() -> int | None:
    """`generation()` while values are loaded; None after `forget_loaded` (or before any load):
    what a caller built at that generation stands exactly while this returns it."""
    return None if _loaded is None else _generation


def forget_loaded() -> None:
    """Drop the loaded values: the next `loaded` parses the environment again (tests)."""
    global _loaded
    with _load_lock:
        _loaded = None


def sized_cache(setting: Setting[int]) -> Callable[[Function], Function]:
    """`functools.lru_cache` with `setting`'s loaded value as its size, built at the first call.

    Decorating reads nothing (no knob at import); a later `load` rebuilds the
    cache at its next call.
    """

    def decorate(function: Function) -> Function:
        built: list[tuple[int, Any]] = []  # (generation, lru-cached function)

        @functools.wraps(function)
        def cached(*args: Any) -> Any:
            if not built or built[-1][0] != _generation:
                size = loaded(setting)
                built[:] = [(_generation, functools.lru_cache(maxsize=size)(function))]
            return built[-1][1](*args)

        cached.cache_clear = lambda: built.clear()  # type: ignore[attr-defined]
        return cached  # type: ignore[return-value]

    return decorate


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


def _count(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text, 0)
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(text)
        return value

    return parse


MAX_STAGING_BYTES = 1 << 47  # x86-64's user address space: no allocation can be larger


def _seconds(text: str) -> float | None:
    """Seconds in (0, threading.TIMEOUT_MAX], or `none` for no bound."""
    if text.lower() == "none":
        return None
    value = float(text)
    if not (math.isfinite(value) and 0 < value <= threading.TIMEOUT_MAX):
        raise ValueError(text)
    return value


def _number(minimum: float, *, inclusive: bool = True) -> Callable[[str], float]:
    """A finite number at least (`inclusive`) or above `minimum`."""

    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            raise ValueError(text)
        return value

    return parse


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
    "always Python lists (Mooncake <= 0.3.13's form); with arrays, an engine without them "
    "is refused (the sglang hooks then run sglang's own code, counted)",
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
    "peer buffer layouts each sglang hook keeps built",
)
GATHER_STAGING_BYTES = Setting(
    "GPU_PLANNER_GATHER_STAGING_BYTES",
    128 << 20,
    _count(0, MAX_STAGING_BYTES),
    "an integer from 0 to 2**47",
    "bytes of staging, registered with Mooncake once per KV manager, that head-sliced sends "
    "from a lower prefill TP gather into (four slots, at most two per send: one gathered while "
    "the other is sent); 0 sends per-token descriptors",
)
RECEIVE_STAGING_BYTES = Setting(
    "GPU_PLANNER_RECEIVE_STAGING_BYTES",
    256 << 20,
    _count(0, MAX_STAGING_BYTES),
    "an integer from 0 to 2**47",
    "bytes of the decode's receive staging, registered with Mooncake once per KV manager and "
    "advertised to gpu_planner prefills, which write a fragmented or head-sliced send into it "
    "as a few large pieces that the decode scatters into its pages; 0 turns it off on that "
    "decode (its prefills send as before)",
)
STAGING_MIN_DESCRIPTORS = Setting(
    "GPU_PLANNER_STAGING_MIN_DESCRIPTORS",
    64,
    _count(1, 2**62),
    "an integer from 1 to 2**62",
    "set explicitly: overrides the cost model (gate): a prefill writes a send through the "
    "decode's receive staging only when it would otherwise take at least this many descriptors "
    "(fewer: sent as planned, counted); either knob set, the gate of both decides; neither "
    "set, the send-path cost model chooses",
)
STAGING_MAX_MEAN_BYTES = Setting(
    "GPU_PLANNER_STAGING_MAX_MEAN_BYTES",
    64 << 10,
    _count(1, 2**62),
    "an integer from 1 to 2**62",
    "set explicitly: overrides the cost model (gate): a prefill writes a send through the "
    "decode's receive staging only when its descriptors would average at most this many bytes "
    "(larger ones gain less than the gather and scatter cost: sent as planned, counted); "
    "either knob set, the gate of both decides; neither set, the send-path cost model chooses",
)


def _within(low: float, high: float, *, low_inclusive: bool = True) -> Callable[[str], float]:
    """A finite number from `low` (or above it) to `high`: a cost model seed, within what the
    model's arithmetic carries (its clamps: integration/sglang/path_fit.py). The parser's
    `bounds` attribute is (low, high)."""

    def parse(text: str) -> float:
        value = float(text)
        if not (low < value <= high or (low_inclusive and value == low)):
            raise ValueError(text)
        return value

    parse.bounds = (low, high)  # type: ignore[attr-defined]
    return parse


_EVIDENCE = "docs/benchmarks.md, \"The cost model's evidence\", for the default's measurement"
COST_DIRECT_FIXED_US = Setting(
    "GPU_PLANNER_COST_DIRECT_FIXED_US",
    100.0,
    _within(0, 1e6),
    "microseconds from 0 to 1,000,000",
    "the send-path cost model's seed for a direct send's fixed cost: every decode starts from "
    f"it and learns its own from its completed sends ({_EVIDENCE})",
)
COST_STAGED_FIXED_US = Setting(
    "GPU_PLANNER_COST_STAGED_FIXED_US",
    1400.0,
    _within(0, 1e6),
    "microseconds from 0 to 1,000,000",
    "the cost model's seed for a staged send's fixed cost on the prefill, up to the decode's "
    f"note (learned per decode; {_EVIDENCE})",
)
COST_REQUEST_US = Setting(
    "GPU_PLANNER_COST_REQUEST_US",
    40.0,
    _within(0.01, 1e4),
    "microseconds from 0.01 to 10,000",
    "the cost model's seed for one Mooncake request to a peer: a direct send's descriptor and a "
    f"staged send's piece (each learned per decode; RDMA: a few us; {_EVIDENCE})",
)
COST_LINK_GB_S = Setting(
    "GPU_PLANNER_COST_LINK_GB_S",
    1.6,
    _within(1e-3, 1e4),
    "GB/s (10^9 bytes per second) from 0.001 to 10,000",
    "the cost model's seed for the link's bandwidth to a peer: a direct send's bytes, and with "
    "the gather in series a staged send's (each learned per decode from its own path's sends; "
    f"RDMA: 25-50 GB/s; {_EVIDENCE})",
)
COST_GATHER_GB_S = Setting(
    "GPU_PLANNER_COST_GATHER_GB_S",
    4.0,
    _within(1e-3, 1e4),
    "GB/s from 0.001 to 10,000",
    "the cost model's seed for the staged send's gather on the prefill's KV device (in series "
    f"with the link: the staged bytes' seed, learned per decode; {_EVIDENCE})",
)
COST_SCATTER_GB_S = Setting(
    "GPU_PLANNER_COST_SCATTER_GB_S",
    8.0,
    _within(1e-3, 1e4),
    "GB/s from 0.001 to 10,000",
    "the cost model's figure for the decode's scatter of a staged send (the prefill never sees "
    f"it: not learned; worth setting to what the decode measures; {_EVIDENCE})",
)
COST_SCATTER_FIXED_US = Setting(
    "GPU_PLANNER_COST_SCATTER_FIXED_US",
    250.0,
    _within(0, 1e6),
    "microseconds from 0 to 1,000,000",
    f"the cost model's figure for the decode scatter's fixed cost (not learned; {_EVIDENCE})",
)
COST_PROBE_INTERVAL = Setting(
    "GPU_PLANNER_COST_PROBE_INTERVAL",
    64,
    _count(0, 1 << 20),
    "an integer from 0 to 2**20",
    "a regular probe of a peer takes the path the cost model prices slower where it is priced "
    "at most 25% slower per whole interval of this many choices that path went untaken: a path "
    "priced r times the other is probed once per about 4 (r - 1) intervals, so by the model "
    "probes cost at most 1 / (4 x this) of the send time (0.4% at 64; below the table); 0 "
    "never probes",
)
BATCH_TIMEOUT_S = Setting(
    "GPU_PLANNER_BATCH_TIMEOUT_S",
    60.0,
    _seconds,
    "seconds in (0, threading.TIMEOUT_MAX], or none",
    "default bound on one batch of MooncakeSender/MooncakeReader",
    AT_CONSTRUCTION,
)

MAX_ABANDONED_CALLS = Setting(
    "GPU_PLANNER_MAX_ABANDONED_CALLS",
    16,
    _count(1),
    "an integer >= 1",
    "default cap on engine calls of timed-out batches still running per "
    "MooncakeSender/MooncakeReader; at the cap batches are refused until they end",
    AT_CONSTRUCTION,
)

SETTINGS: tuple[Setting, ...] = (
    DISABLE,
    HANDOFF,
    STAGING_RETAINED_BYTES,
    ADDRESS_RETAINED_BYTES,
    LAYOUT_CACHE_SIZE,
    GATHER_STAGING_BYTES,
    RECEIVE_STAGING_BYTES,
    STAGING_MIN_DESCRIPTORS,
    STAGING_MAX_MEAN_BYTES,
    COST_DIRECT_FIXED_US,
    COST_STAGED_FIXED_US,
    COST_REQUEST_US,
    COST_LINK_GB_S,
    COST_GATHER_GB_S,
    COST_SCATTER_GB_S,
    COST_SCATTER_FIXED_US,
    COST_PROBE_INTERVAL,
    BATCH_TIMEOUT_S,
    MAX_ABANDONED_CALLS,
)


def markdown_table() -> str:
    """docs/settings.md's table: every setting, its default, what it accepts and bounds."""
    rows = [
        "| variable | default | accepts | what it does | read |",
        "| --- | --- | --- | --- | --- |",
    ]
    for setting in SETTINGS:
        default = setting.default
        default = (
            "none" if default is None else int(default) if isinstance(default, bool) else default
        )
        rows.append(
            f"| `{setting.name}` | `{default}` | {setting.accepts} | {setting.meaning} "
            f"| {setting.read} |"
        )
    return "\n".join(rows) + "\n"

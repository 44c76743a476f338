"""`gpu-planner info`: what gpu_planner finds in this environment (run it in your sglang env).

Versions of the packages it works with, whether the sglang plugin would load
and hook each target (the plugin's own checks, without registering), the
backend each kind of page list gets, and the Mooncake hand-off (arrays or
lists) that the installed Mooncake gives.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util

import torch

from gpu_planner import settings

PACKAGES = {  # shown name: distribution name
    "gpu_planner": "gpu-planner",
    "sglang": "sglang",
    "torch": "torch",
    "Triton": "triton",
    "Numba": "numba",
    "NumPy": "numpy",
    "nvtx": "nvtx",
}
NOT_INSTALLED = "not installed"

Section = list[tuple[str, str]]


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return NOT_INSTALLED


def mooncake_distributions() -> list[str]:
    """The installed distributions that provide the `mooncake` package, as `name version`.

    The non-CUDA, CUDA 12 and CUDA 13 builds ship the same package; more than
    one means one overwrote the other's files.
    """
    names = importlib.metadata.packages_distributions().get("mooncake", [])
    return [f"{name} {_version(name)}" for name in sorted(set(names))]


def versions() -> Section:
    rows = [(shown, _version(distribution)) for shown, distribution in PACKAGES.items()]
    found = mooncake_distributions()
    mooncake = ", ".join(found) or NOT_INSTALLED
    if len(found) > 1:
        mooncake += " (several builds of one package: reinstall the one you run)"
    return [*rows, ("Mooncake", mooncake)]


def sglang_plugin() -> Section:
    """Would sglang's `load_plugins()` load gpu_planner, and which targets would it hook."""
    from gpu_planner.integration.sglang.plugin import plugin_disabled

    points = importlib.metadata.entry_points(group="sglang.srt.plugins")
    if not any(point.name == "gpu_planner" for point in points):
        return [("plugin", "no sglang.srt.plugins entry point named gpu_planner")]
    if plugin_disabled():
        return [("plugin", "GPU_PLANNER_DISABLE is set: sglang plans its own transfers")]
    if importlib.util.find_spec("sglang") is None:
        return [("plugin", "sglang is not installed")]
    from gpu_planner.integration.sglang.plugin import (
        hook_records,
        left_to_sglang,
        why_not_registered,
    )

    try:
        records = hook_records()
    except ImportError as error:
        reason = f"sglang's Mooncake connector does not import ({error})"
        return [("plugin", f"would not load: {reason}")]
    refusals = why_not_registered(records)
    left = left_to_sglang(records, refusals)
    rows = [("plugin", "would load" + (f"; {left}" if left else ", every hook registers"))]
    for record in records:
        mismatch = refusals[record.target]
        status = "hooked" if mismatch is None else f"not hooked: {mismatch}"
        rows.append((record.target, status))
    return rows


def backends() -> Section:
    """The backend `plan_transfer` picks for each kind of page list."""
    from gpu_planner.inputs import HOST, resolve_backend

    cuda = resolve_backend(None, torch.device("cuda"))
    if not torch.cuda.is_available():
        cuda += " (no CUDA device visible here)"
    return [
        ("NumPy array", resolve_backend(None, HOST)),
        ("CPU tensor", resolve_backend(None, HOST)),
        ("CUDA tensor", cuda),
        ("sglang send hook", f"{resolve_backend(None, HOST)} (sglang passes NumPy page lists)"),
    ]


def mooncake_handoff() -> Section:
    """The hand-off path the installed Mooncake engine class gives, per direction."""
    from gpu_planner.integration.mooncake import handoff

    try:
        from mooncake.engine import TransferEngine
    except ImportError as error:
        return [("hand-off", f"Mooncake's engine does not import ({error})")]
    asked = settings.loaded(settings.HANDOFF)
    note = "" if asked == "auto" else f" ({settings.HANDOFF.name}={asked})"
    rows = []
    for direction in ("write", "read"):
        try:
            form = handoff.engine_form(TransferEngine, direction) + note
        except settings.SettingError as error:
            form = f"refused: {error}"
        rows.append((f"{direction} hand-off", form))
    return rows


def receive_staging() -> Section:
    """Whether a decode here would advertise receive staging, and what a prefill stages."""
    nbytes = settings.loaded(settings.RECEIVE_STAGING_BYTES)
    region = (
        f"off ({settings.RECEIVE_STAGING_BYTES.name}=0)"
        if nbytes == 0
        else f"on: {nbytes} bytes ({nbytes / 2**20:g} MiB) per decode KV manager"
    )
    count = settings.loaded(settings.STAGING_MIN_DESCRIPTORS)
    mean = settings.loaded(settings.STAGING_MAX_MEAN_BYTES)
    gate = f"sends of >= {count} descriptors of <= {mean} bytes on average"
    return [
        ("decode region", region),
        ("prefill stages", f"{gate}, to decodes that offer staging"),
    ]


SHOWN_MEANS = (1024, 4096, 16384, 65536)  # descriptor sizes whose staging crossover info shows
SHOWN_PEERS = 8  # peers whose learned figures info shows (the most recently used)


def send_path() -> Section:
    """The send-path cost model: how it chooses, its seeds, where they stage, peers learned here."""
    from gpu_planner.integration.sglang import path_cost, send_slots

    costs = path_cost.path_costs()
    seeds = costs.seeds
    if costs.gate is None:
        chooser = "the cost model, per peer, learned from its completed sends"
    else:
        knobs = f"{settings.STAGING_MIN_DESCRIPTORS.name} or {settings.STAGING_MAX_MEAN_BYTES.name}"
        chooser = f"{costs.gate.describe()} ({knobs} set: the cost model only prices)"
    direct, staged = seeds.describe()
    slot_bytes = settings.loaded(settings.GATHER_STAGING_BYTES) // send_slots.SLOTS
    if slot_bytes:
        crossovers = []
        for mean in SHOWN_MEANS:
            count = seeds.stages_from(mean, slot_bytes)
            size = f"{mean // 1024} KiB"
            crossovers.append(f"never at {size}" if count is None else f"{count} of {size}")
        stages = "descriptors: " + ", ".join(crossovers)
    else:
        stages = f"never: no send slots ({settings.GATHER_STAGING_BYTES.name}=0)"
    interval = costs.probe_interval
    probe = (
        f"at most 1 send in {interval} per peer on the path priced slower, when priced at most "
        f"{path_cost.PROBE_MAX_LOSS:.0%} slower per {interval} choices it went untaken (by the "
        f"model, at most {path_cost.PROBE_MAX_LOSS / interval:.2%} of the send time)"
        if interval
        else f"off ({settings.COST_PROBE_INTERVAL.name}=0)"
    )
    rows = [
        ("chooses by", chooser),
        ("seeded direct", direct),
        ("seeded staged", staged),
        ("seeds stage from", stages),
        ("probe", probe),
    ]
    peers = costs.peers()[-SHOWN_PEERS:]
    if not peers:
        rows.append(("peers", "none in this process: each starts from the seeds"))
    for peer in reversed(peers):
        figures = costs.figures(peer)
        direct, staged = figures.describe()
        sends = f"{figures.sends[0]} direct and {figures.sends[1]} staged sends"
        rows.append((f"peer {peer}", f"direct {direct}; staged {staged} (learned from {sends})"))
    return rows


def report() -> str:
    """Every section, as aligned `name  value` lines under a heading each."""
    sections = {
        "versions": versions(),
        "sglang plugin": sglang_plugin(),
        "planner backend by input": backends(),
        "Mooncake hand-off": mooncake_handoff(),
        "receive staging": receive_staging(),
        "send path by cost": send_path(),
    }
    width = max(len(name) for rows in sections.values() for name, _ in rows)
    lines = []
    for heading, rows in sections.items():
        lines.append(f"{heading}:")
        lines += [f"  {name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    print(report())
    return 0


def add_command(subparsers: argparse._SubParsersAction) -> None:
    """Add `info` to the `gpu-planner` parser (the `gpu_planner.commands` entry point)."""
    parser = subparsers.add_parser(
        "info", help="versions, sglang plugin status, planner backends and Mooncake hand-off"
    )
    parser.set_defaults(run=run)

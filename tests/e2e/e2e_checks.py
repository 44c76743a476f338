"""Assertions the e2e scenarios share: token identity and what the plugin's metrics must show."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from bench.servers.client import Generation, server_metrics


def assert_same_tokens(
    name: str,
    prompts: Sequence[Sequence[int]],
    generations: Sequence[Generation],
    reference: dict[tuple[int, ...], tuple[int, ...]],
) -> None:
    """Every prompt's greedy tokens equal the plain server's; the message lists the differences."""
    differ = [
        (len(prompt), generation.output_ids, reference[tuple(prompt)])
        for prompt, generation in zip(prompts, generations, strict=True)
        if generation.output_ids != reference[tuple(prompt)]
    ]
    assert not differ, f"{name}: {len(differ)} prompts differ (length, got, plain): {differ}"


def sends_above(metrics: dict[str, float], runs_per_buffer: int) -> float:
    """Sends with more than `runs_per_buffer` runs per buffer (histogram buckets above it)."""
    histogram = runs_histogram(metrics)
    return sum(count for bucket, count in histogram.items() if float(bucket[2:]) > runs_per_buffer)


def runs_histogram(metrics: dict[str, float]) -> dict[str, float]:
    """Sends per `runs_per_buffer` bucket: {'<=1': n, '<=2': n, ..., '+Inf': n}, not cumulative."""
    prefix = "gpu_planner:runs_per_buffer_bucket{le="
    buckets = sorted(
        (
            (float(key[len(prefix) : -1]), value)
            for key, value in metrics.items()
            if key.startswith(prefix)
        ),
    )
    histogram, below = {}, 0.0
    for bound, cumulative in buckets:
        histogram[f"<={bound:g}"] = cumulative - below
        below = cumulative
    return histogram


# The one fallback a CPU prefill counts: sglang's fake transfers (its warm-up request and
# health checks; `FakeKVSender` has no host tensor indices) convert pages of CPU tensors with
# `kv_to_page_indices`, which the page hook leaves to sglang (on a GPU it converts them).
PAGES_ON_HOST = "gpu_planner:fallbacks_total{reason=pages on host}"


def plugin_metrics(
    url: str, handoff: str, record: Path, hooks: tuple[str, ...] = ("generic",)
) -> dict[str, float]:
    """The plugin's metrics from the prefill `url`'s /metrics, written to `record` (JSON), after
    the checks every scenario shares: sends of `hooks` on `handoff` only, descriptors and
    bytes, no fallback but `PAGES_ON_HOST`, and that one only for sglang's fake transfers:
    the servers take a CUDA prefill's path (the CPU scaffolding's `HostTorch`), where sglang
    divides a real send's pages and copies them to pinned memory itself, so no real send
    calls the page hook (on the other path each would count one here)."""
    metrics = server_metrics(url)
    record.write_text(json.dumps({**metrics, "runs_histogram": runs_histogram(metrics)}, indent=1))
    sends = {key for key in metrics if key.startswith("gpu_planner:sends_total")}
    expected = {f"gpu_planner:sends_total{{handoff={handoff},hook={hook}}}" for hook in hooks}
    assert sends and sends <= expected, f"sends {sorted(sends)}, expected some of {expected}"
    assert metrics["gpu_planner:descriptors_total"] > 0
    assert metrics["gpu_planner:bytes_total"] > 0
    fallbacks = [k for k in metrics if k.startswith("gpu_planner:fallbacks") and k != PAGES_ON_HOST]
    assert not fallbacks, {key: metrics[key] for key in fallbacks}
    real_sends = sum(metrics[key] for key in sends)
    assert metrics.get(PAGES_ON_HOST, 0) < real_sends / 2, (metrics.get(PAGES_ON_HOST), real_sends)
    return metrics

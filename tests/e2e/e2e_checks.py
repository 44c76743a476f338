"""Assertions the e2e scenarios share: token identity and what the plugin's metrics must show."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import requests

from bench.servers.client import REQUEST_TIMEOUT_S, Generation, pd_payload, server_metrics
from bench.servers.launcher import Server


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


def assert_repaged_sends(
    url: str, handoff: str, record: Path, prompts: Sequence[Sequence[int]]
) -> dict[str, float]:
    """The checks of a plugin prefill that served a decode of another page size (`url`, after
    `prompts` went through it): `plugin_metrics`'s, every chunk planned by the plugin (more
    sends than requests: long prompts take several chunks; a repaged chunk has no fallback to
    sglang, whose code cannot address the decode's pages) and no send failed."""
    metrics = plugin_metrics(url, handoff, record)
    sends = metrics[f"gpu_planner:sends_total{{handoff={handoff},hook=generic}}"]
    assert sends > len(prompts), f"{sends} sends for {len(prompts)} requests: no chunked send"
    failed = {key: value for key, value in metrics.items() if "failed_sends" in key}
    assert not failed, failed
    return metrics


def assert_cache_hits(generations: Sequence[Generation]) -> None:
    """Some requests hit the prefill's radix cache (the shared prefix of `MIXED_PROMPTS`)."""
    cached = [generation.prefill_meta["cached_tokens"] for generation in generations]
    assert sum(cached) > 0, cached


def assert_mismapped_then_right(
    send: Callable[[Sequence[int]], Generation],
    flag: Path,
    prompt: Sequence[int],
    reference: dict[tuple[int, ...], tuple[int, ...]],
) -> None:
    """The page-size mapping control (`E2E_MISMAP_PAGES_FLAG`): with the flag, one later chunk
    of `prompt` (which the prefill has not cached: it goes in several chunks) goes to the
    decode pages sglang's own chunking would address, and the tokens differ from the second
    on (the first comes from the prefill); the next send of the same prompt is right again."""
    expected = reference[tuple(prompt)]
    flag.touch()
    corrupted = send(prompt)
    assert not flag.exists(), "no chunk after a request's first took the mapping control's flag"
    assert corrupted.output_ids[0] == expected[0]
    assert corrupted.output_ids[1:] != expected[1:], "a wrong page mapping changed no token"
    clean = send(prompt)
    assert clean.output_ids == expected, (clean.output_ids, expected)


def post_reply(url: str, payload: dict) -> tuple[int, object]:
    """(HTTP status, JSON body or text) of a /generate, whatever its status."""
    response = requests.post(url + "/generate", json=payload, timeout=REQUEST_TIMEOUT_S)
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


def aborted(status: int, body: object) -> bool:
    """Whether a /generate reply says its request was aborted (sglang answers 200 or an error)."""
    finish = body.get("meta_info", {}).get("finish_reason", {}) if isinstance(body, dict) else {}
    return status != 200 or finish.get("type") == "abort"


def assert_plain_prefill_fails(
    prefill: Server, decode: Server, prompt: Sequence[int], page_sizes: tuple[int, int]
) -> None:
    """A plain sglang `prefill` (`GPU_PLANNER_DISABLE=1`) toward a plugin `decode` of another
    page size (`page_sizes`: the prefill's, the decode's): the decode sends the request's pages
    only in gpu_planner's frame, sglang's prefill writes none and declares no plan, and the
    decode fails the request (its reply aborted), naming both page sizes."""
    payload = pd_payload(prompt, prefill.bootstrap_port)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        prefill_reply = pool.submit(post_reply, prefill.url, payload)
        status, body = post_reply(decode.url, payload)
        prefill_reply.result()
    assert aborted(status, body), (status, body)
    reason = str(body)
    own, decodes = page_sizes
    assert f"(page size {own})" in reason and f"(page size {decodes})" in reason, body
    assert "a plain sglang prefill" in reason, body

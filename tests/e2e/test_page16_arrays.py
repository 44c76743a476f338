"""Page size 16, Mooncake 0.3.14 (arrays hand-off): the plugin against sglang's own planning.

One decode server and two prefill servers that send to it: one with the plugin,
one with `GPU_PLANNER_DISABLE=1` (sglang's own code). The same mixed prompts go
through each; the greedy tokens must equal a plain server's. A small KV pool,
chunked prefill and `SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES=4` make sends
with fragmented page lists, several transfers per long request and batch cuts,
which the plugin's metrics must show. The corruption control (test
scaffolding) leaves one page out of one send and the tokens must change.

A third prefill, at page size 64 with the plugin, sends to the same page-16
decode: a pair sglang alone refuses, which the plugin serves (each chunk
planned as pages of 16 tokens on both sides). Its tokens must be the plain
server's too, prefix-cache hits included, and the mapping control (test
scaffolding: one chunk sent to the decode pages sglang's own chunking would
address) must change them.

The decode runs its radix cache (`--disaggregation-decode-enable-radix-cache`):
its prefix hits are whole pages of 16, so toward the page-64 prefill they end
inside a prefill page (96 tokens: a page and a half), whose held tokens the
sends skip. The controls empty it first (`/flush_cache`), so a control's wrong
KV serves no later request.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import requests

from bench.deployment import one_request
from bench.servers.client import (
    Generation,
    generate_all,
    generate_pd,
    prompt_set,
    server_metrics,
)
from bench.servers.launcher import Server, servers_running
from tests.e2e.e2e_checks import (
    assert_cache_hits,
    assert_mismapped_then_right,
    assert_repaged_sends,
    assert_same_tokens,
    plugin_metrics,
    runs_histogram,
    sends_above,
)
from tests.e2e.e2e_scenarios import (
    CONCURRENCY,
    CONTROL_PROMPT,
    MIXED_PROMPTS,
    decode_spec,
    prefill_spec,
)
from tests.e2e.scaffolding.e2e_sglang_scaffolding import CORRUPT_FLAG_ENV, MISMAP_PAGES_FLAG_ENV

pytestmark = pytest.mark.e2e

PAGE_SIZE = 16
BATCH_PAGES = 4
REPAGED_PAGE_SIZE = 64  # the third prefill's: the decode's is PAGE_SIZE
DECODE_RADIX_CACHE = ("--disaggregation-decode-enable-radix-cache",)


@dataclasses.dataclass
class Deployment:
    decode: Server
    prefill: Server  # the plugin
    prefill_disabled: Server  # GPU_PLANNER_DISABLE=1
    prefill_p64: Server  # the plugin, page size 64
    corrupt_flag: Path  # create it to corrupt the plugin prefill's next send
    mismap_flag: Path  # create it to mismap the page-64 prefill's next later chunk
    logs: Path

    def flush_decode_cache(self) -> None:
        """Empty the decode's radix cache: a control's wrong KV must not serve a later send."""
        response = requests.post(self.decode.url + "/flush_cache", timeout=60)
        assert response.status_code == 200, response.text

    def send(self, prefill: Server, prompts) -> list[Generation]:
        def one(ids):
            return generate_pd(prefill.url, prefill.bootstrap_port, self.decode.url, ids)

        return generate_all(one, prompts, CONCURRENCY)


@pytest.fixture(scope="module")
def deployment(tiny_model, server_logs, tmp_path_factory, reference_tokens):
    """The four servers; the plain reference server (`reference_tokens`) runs before them,
    alone, so the machine holds four servers at most."""
    control = tmp_path_factory.mktemp("control")
    flag, mismap_flag = control / "corrupt-next-send", control / "mismap-next-chunk"
    specs = [
        decode_spec("p16-decode", tiny_model, PAGE_SIZE, BATCH_PAGES, extra=DECODE_RADIX_CACHE),
        prefill_spec(
            "p16-prefill", tiny_model, PAGE_SIZE, BATCH_PAGES, {CORRUPT_FLAG_ENV: str(flag)}
        ),
        prefill_spec(
            "p16-prefill-disabled", tiny_model, PAGE_SIZE, BATCH_PAGES, {"GPU_PLANNER_DISABLE": "1"}
        ),
        prefill_spec(
            "p64-prefill",
            tiny_model,
            REPAGED_PAGE_SIZE,
            BATCH_PAGES,
            {MISMAP_PAGES_FLAG_ENV: str(mismap_flag)},
        ),
    ]
    with servers_running(specs, server_logs) as servers:
        yield Deployment(
            servers["p16-decode"],
            servers["p16-prefill"],
            servers["p16-prefill-disabled"],
            servers["p64-prefill"],
            flag,
            mismap_flag,
            server_logs,
        )


@pytest.fixture(scope="module")
def generations(deployment) -> dict[str, list[Generation]]:
    """The mixed prompts through the plugin's prefill, then through sglang's own."""
    return {
        "plugin": deployment.send(deployment.prefill, MIXED_PROMPTS),
        "disabled": deployment.send(deployment.prefill_disabled, MIXED_PROMPTS),
    }


def test_tokens_equal_with_plugin_without_it_and_on_a_plain_server(generations, reference_tokens):
    assert_same_tokens("plugin", MIXED_PROMPTS, generations["plugin"], reference_tokens)
    assert_same_tokens("disabled", MIXED_PROMPTS, generations["disabled"], reference_tokens)


def test_plugin_planned_fragmented_chunked_batched_sends(deployment, generations):
    metrics = plugin_metrics(deployment.prefill.url, "arrays", deployment.logs / "p16-metrics.json")
    sends = metrics["gpu_planner:sends_total{handoff=arrays,hook=generic}"]
    assert sends > len(MIXED_PROMPTS), "chunked prefill: long prompts need several transfers"
    assert metrics["gpu_planner:fragmented_sends_total"] > 0, "no page list broke"
    assert sends_above(metrics, 4) > 0, (
        f"no send above 4 runs per buffer: {runs_histogram(metrics)}"
    )
    assert metrics["gpu_planner:batch_cuts_total"] > 0
    # sglang's own metrics are served beside the plugin's.
    assert server_metrics(deployment.prefill.url, "sglang:")


def test_disabled_prefill_planned_nothing(deployment, generations):
    assert server_metrics(deployment.prefill_disabled.url) == {}


def test_prefix_cache_hits(generations):
    assert_cache_hits(generations["plugin"])


def test_corrupted_transfer_changes_the_tokens(deployment, reference_tokens):
    """The control: one page of one send left out, other tokens; the next send is right again."""
    expected = reference_tokens[tuple(CONTROL_PROMPT)]
    deployment.flush_decode_cache()  # the whole prompt goes, in several sends
    deployment.corrupt_flag.touch()
    [corrupted] = deployment.send(deployment.prefill, [CONTROL_PROMPT])
    assert not deployment.corrupt_flag.exists(), "the scaffolding did not take the flag"
    deployment.flush_decode_cache()
    # The prefill computes the first token; decode reads the transferred KV from the second on.
    assert corrupted.output_ids[0] == expected[0]
    assert corrupted.output_ids[1:] != expected[1:]
    [clean] = deployment.send(deployment.prefill, [CONTROL_PROMPT])
    assert clean.output_ids == expected


def test_deployment_benchmark_measures_a_request_on_each_prefill(deployment):
    """bench.deployment's per-request figures, on this deployment (the benchmark's own)."""
    [prompt] = prompt_set(seed=3, lengths=(200,))
    plugin = one_request(deployment.prefill, deployment.decode, prompt)
    sglang = one_request(deployment.prefill_disabled, deployment.decode, prompt)
    for figures in (plugin, sglang):
        assert 0 < figures["transfer"] < figures["ttft"]
    assert plugin["plan"] > 0 and plugin["descriptors"] > 0
    assert sglang["plan"] == 0 and sglang["descriptors"] == 0


@pytest.fixture(scope="module")
def repaged(deployment) -> list[Generation]:
    """The mixed prompts through the page-64 prefill to the page-16 decode, whose radix cache
    starts empty: their shared 96-token prefix hits it (6 decode pages, a prefill page and a
    half), so those requests' sends start inside a prefill page."""
    deployment.flush_decode_cache()
    return deployment.send(deployment.prefill_p64, MIXED_PROMPTS)


def test_page64_prefill_to_page16_decode_equals_a_plain_server(
    deployment, repaged, reference_tokens
):
    """Prefill page 64 -> decode page 16 (sglang refuses the pair): the plain server's tokens,
    prefix-cache hits on the prefill included, every chunk planned by the plugin."""
    assert_same_tokens("page 64 -> 16", MIXED_PROMPTS, repaged, reference_tokens)
    assert_cache_hits(repaged)
    # The decode's prefix hits (whole pages of 16) that end inside a prefill page of 64: those
    # sends skip the tokens of that page the decode holds.
    decode_hits = [generation.meta["cached_tokens"] for generation in repaged]
    assert any(hit % REPAGED_PAGE_SIZE for hit in decode_hits), decode_hits
    record = deployment.logs / "p64-to-p16-metrics.json"
    assert_repaged_sends(deployment.prefill_p64.url, "arrays", record, MIXED_PROMPTS)


def test_a_wrong_page_mapping_changes_the_tokens(deployment, repaged, reference_tokens):
    """The mapping control: one chunk of the page-64 prefill's next request to the decode pages
    sglang's own chunking would address, other tokens; the next send is right again."""

    def send(ids):
        deployment.flush_decode_cache()  # each send whole: no KV of an earlier one is reused
        return deployment.send(deployment.prefill_p64, [ids])[0]

    assert_mismapped_then_right(send, deployment.mismap_flag, CONTROL_PROMPT, reference_tokens)

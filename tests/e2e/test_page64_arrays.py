"""Page size 64, Mooncake 0.3.14 (arrays hand-off), two pages per Mooncake batch.

At page size 64 a 256-token chunk is four pages, so runs are short; batches of
two pages cut almost every send.
"""

from __future__ import annotations

import pytest

from bench.servers.client import generate_all, generate_pd
from bench.servers.launcher import servers_running
from tests.e2e.e2e_checks import assert_same_tokens, plugin_metrics, runs_histogram, sends_above
from tests.e2e.e2e_scenarios import CONCURRENCY, MIXED_PROMPTS, decode_spec, prefill_spec

pytestmark = pytest.mark.e2e

PAGE_SIZE = 64
BATCH_PAGES = 2


@pytest.fixture(scope="module")
def servers(tiny_model, server_logs):
    specs = [
        decode_spec("p64-decode", tiny_model, PAGE_SIZE, BATCH_PAGES),
        prefill_spec("p64-prefill", tiny_model, PAGE_SIZE, BATCH_PAGES),
    ]
    with servers_running(specs, server_logs) as running:
        yield running


@pytest.fixture(scope="module")
def generations(servers):
    prefill, decode = servers["p64-prefill"], servers["p64-decode"]

    def one(ids):
        return generate_pd(prefill.url, prefill.bootstrap_port, decode.url, ids)

    return generate_all(one, MIXED_PROMPTS, CONCURRENCY)


def test_tokens_equal_a_plain_server(generations, reference_tokens):
    assert_same_tokens("page 64", MIXED_PROMPTS, generations, reference_tokens)


def test_plugin_planned_runs_and_batch_cuts(servers, server_logs, generations):
    metrics = plugin_metrics(servers["p64-prefill"].url, "arrays", server_logs / "p64-metrics.json")
    assert sends_above(metrics, 1) > 0, runs_histogram(metrics)
    assert metrics["gpu_planner:batch_cuts_total"] > 0

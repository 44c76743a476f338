"""Prefill TP 1 -> decode TP 2 (head-sliced sends), page size 16, Mooncake 0.3.14 (arrays).

Each decode rank holds one of the model's two KV heads, so the prefill sends
every token's head slice to each rank: sglang's `send_kvcache_slice`, which
the plugin hooks (`send_slice`, and `gathered` where it gathers the slices
into staging first). The tokens must equal a plain server's (the plugin and
sglang's own planning are compared in `test_page16_arrays.py`). sglang's CPU
path runs TP 2 here with two pieces of test scaffolding: the CPU threads bound
one core per rank
(`SGLANG_CPU_OMP_THREADS_BIND`, this machine has one NUMA node) and pynccl off
(the scaffolding plugin's `without_pynccl`), so the ranks all-reduce with gloo.
"""

from __future__ import annotations

import pytest

from bench.servers.client import generate_all, generate_pd
from bench.servers.launcher import servers_running, sglang_spec
from tests.e2e.e2e_checks import assert_same_tokens, plugin_metrics
from tests.e2e.e2e_scenarios import CONCURRENCY, MIXED_PROMPTS, POOL_TOKENS, prefill_spec

pytestmark = pytest.mark.e2e

PAGE_SIZE = 16
BATCH_PAGES = 1024  # sglang's default; head-sliced sends make one engine call per layer
# The plugin's head-sliced sends: per token and layer (`slice`) or gathered into staging.
SLICE_HOOKS = ("slice", "gathered")
PROMPTS = MIXED_PROMPTS[:12]  # 5 to 333 tokens: TP 2 on two cores is slow


@pytest.fixture(scope="module")
def servers(tiny_model, server_logs):
    decode = sglang_spec(
        "tp2-decode", tiny_model, PAGE_SIZE, "decode",
        "--max-total-tokens", str(POOL_TOKENS), "--tp-size", "2",
        env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
    )  # fmt: skip
    prefill = prefill_spec("tp1-prefill", tiny_model, PAGE_SIZE, BATCH_PAGES)
    with servers_running([decode, prefill], server_logs) as running:
        yield running


@pytest.fixture(scope="module")
def generations(servers):
    prefill, decode = servers["tp1-prefill"], servers["tp2-decode"]

    def one(ids):
        return generate_pd(prefill.url, prefill.bootstrap_port, decode.url, ids)

    return generate_all(one, PROMPTS, CONCURRENCY)


def test_tokens_equal_a_plain_server(generations, reference_tokens):
    assert_same_tokens("TP 1 -> 2", PROMPTS, generations, reference_tokens)


def test_plugin_built_the_head_sliced_sends(servers, server_logs, generations):
    record = server_logs / "tp-metrics.json"
    metrics = plugin_metrics(servers["tp1-prefill"].url, "arrays", record, SLICE_HOOKS)
    sends = sum(value for key, value in metrics.items() if key.startswith("gpu_planner:sends"))
    assert sends >= len(PROMPTS)

"""Receive staging TP-down in real servers: prefill TP 2 -> decode TP 1, 16 layers, page 16.

Each prefill rank holds one of the model's two KV heads, a share of every
decode token slot: sglang sends one descriptor per token per buffer; between
two gpu_planner peers each rank writes its share gathered into the decode's
receive staging, which scatters both shares into the token slots. The same
prefill also sends to a plain decode (`GPU_PLANNER_DISABLE=1`): today's
protocol, nothing staged. The staged tokens must equal those. (Not a plain
TP 1 server's: a TP 2 prefill's all-reduce rounds bf16 otherwise, so even
its first token can differ from TP 1's.)
"""

from __future__ import annotations

import pytest

from tests.e2e.e2e_client import generate_all, generate_pd, server_metrics
from tests.e2e.e2e_scenarios import CONCURRENCY, POOL_TOKENS, STAGING_PROMPTS
from tests.e2e.e2e_servers import servers_running, sglang_spec

pytestmark = pytest.mark.e2e

PAGE_SIZE = 16
PROMPTS = STAGING_PROMPTS[:6]  # TP 2 on two cores is slow


@pytest.fixture(scope="module")
def servers(layered_model, server_logs):
    pool = ("--max-total-tokens", str(POOL_TOKENS))
    specs = [
        sglang_spec("tp1-staging-decode", layered_model, PAGE_SIZE, "decode", *pool),
        sglang_spec(
            "tp1-plain-decode", layered_model, PAGE_SIZE, "decode", *pool,
            env={"GPU_PLANNER_DISABLE": "1"},
        ),
        sglang_spec(
            "tp2-staged-prefill", layered_model, PAGE_SIZE, "prefill", *pool, "--tp-size", "2",
            env={"GPU_PLANNER_STAGING_MIN_DESCRIPTORS": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
        ),
    ]  # fmt: skip
    with servers_running(specs, server_logs) as running:
        yield running


def send(servers, decode: str):
    prefill, sink = servers["tp2-staged-prefill"], servers[decode]

    def one(ids):
        return generate_pd(prefill.url, prefill.bootstrap_port, sink.url, ids)

    return generate_all(one, PROMPTS, CONCURRENCY)


def staged(servers) -> float:
    metrics = server_metrics(servers["tp2-staged-prefill"].url)
    return sum(value for key, value in metrics.items() if "hook=staged" in key)


@pytest.fixture(scope="module")
def todays_tokens(servers):
    """The prefill's tokens through a plain decode (sglang's protocol), and what it staged."""
    before = staged(servers)
    generations = send(servers, "tp1-plain-decode")
    return generations, staged(servers) - before


def test_a_plugin_prefill_to_a_plain_decode_stages_nothing(servers, todays_tokens):
    _, staged_meanwhile = todays_tokens
    assert staged_meanwhile == 0
    assert server_metrics(servers["tp1-plain-decode"].url) == {}


def test_tp_down_staged_tokens_equal_todays(servers, todays_tokens):
    plain, _ = todays_tokens
    generations = send(servers, "tp1-staging-decode")
    differ = [
        (len(prompt), got.output_ids, want.output_ids)
        for prompt, got, want in zip(PROMPTS, generations, plain, strict=True)
        if got.output_ids != want.output_ids
    ]
    assert not differ, f"TP 2 -> 1 staged: (length, staged, today's): {differ}"
    assert staged(servers) >= len(PROMPTS)
    decode = server_metrics(servers["tp1-staging-decode"].url)
    assert decode["gpu_planner:staged_scatters_total"] > 0, decode

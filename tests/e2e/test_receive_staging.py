"""Receive staging in real sglang servers: a 16-layer model, page 16, fragmented pools.

One decode server with the plugin (its receive staging on) and four prefill
servers sending to it, plus a plain decode:

- `staged-prefill` (plugin, staging gate at 1 descriptor): fragmented sends
  of 32 KV buffers go gathered into the decode's region and are scattered
  there: the tokens must equal a plain server's and `/metrics` must show
  staged sends (prefill) and scatters (decode).
- `plain-prefill` (`GPU_PLANNER_DISABLE=1`) to the plugin decode, and
  `staged-prefill-2` (plugin) to a plain decode (`GPU_PLANNER_DISABLE=1`):
  mixed deployments, today's protocol, identical tokens, no staged send.
- `tp2-prefill` (plugin, TP 2 -> decode TP 1): each prefill rank holds one of
  the two KV heads, a share of every decode token slot; staged, the tokens
  must equal a plain server's.

The corruption control leaves one staged page out of one scatter on the
decode (test scaffolding): the tokens must change, and the next request is
right again.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.e2e.e2e_checks import assert_same_tokens
from tests.e2e.e2e_client import (
    Generation,
    generate,
    generate_all,
    generate_pd,
    prompt_set,
    server_metrics,
)
from tests.e2e.e2e_model import write_tiny_llama
from tests.e2e.e2e_scenarios import CONCURRENCY, MIXED_PROMPTS, POOL_TOKENS, prefill_spec
from tests.e2e.e2e_servers import Server, servers_running, sglang_spec
from tests.e2e.scaffolding.e2e_sglang_scaffolding import CORRUPT_SCATTER_FLAG_ENV

pytestmark = pytest.mark.e2e

PAGE_SIZE = 16
LAYERS = 16
BATCH_PAGES = 1024  # sglang's default: staging, not batch cuts, is what this module checks
PROMPTS = MIXED_PROMPTS[:16]  # 5 to 600 tokens, shared prefixes: a 16-layer model is slower
TP2_PROMPTS = MIXED_PROMPTS[:8]  # TP 2 on two cores is slower still
CONTROL_PROMPT = prompt_set(seed=4, lengths=(400,))[0]
STAGED = {"GPU_PLANNER_STAGING_MIN_DESCRIPTORS": "1"}
OFF = {"GPU_PLANNER_DISABLE": "1"}


@dataclasses.dataclass
class Deployment:
    servers: dict[str, Server]
    corrupt_flag: Path  # create it to corrupt the decode's next scatter

    def send(self, prefill: str, prompts, decode: str = "decode") -> list[Generation]:
        source, sink = self.servers[prefill], self.servers[decode]

        def one(ids):
            return generate_pd(source.url, source.bootstrap_port, sink.url, ids)

        return generate_all(one, prompts, CONCURRENCY)


@pytest.fixture(scope="module")
def layered_model(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-16"), seed=1, layers=LAYERS)


@pytest.fixture(scope="module")
def deployment(layered_model, server_logs, tmp_path_factory):
    flag = tmp_path_factory.mktemp("scatter-control") / "corrupt-next-scatter"
    pool = ("--max-total-tokens", str(POOL_TOKENS))
    specs = [
        sglang_spec("plain", layered_model, PAGE_SIZE, "plain", "--max-total-tokens", "4096"),
        sglang_spec(
            "decode", layered_model, PAGE_SIZE, "decode", *pool,
            env={CORRUPT_SCATTER_FLAG_ENV: str(flag)},
        ),
        sglang_spec("plain-decode", layered_model, PAGE_SIZE, "decode", *pool, env=OFF),
        prefill_spec("staged-prefill", layered_model, PAGE_SIZE, BATCH_PAGES, STAGED),
        prefill_spec("staged-prefill-2", layered_model, PAGE_SIZE, BATCH_PAGES, STAGED),
        prefill_spec("plain-prefill", layered_model, PAGE_SIZE, BATCH_PAGES, OFF),
        sglang_spec(
            "tp2-prefill", layered_model, PAGE_SIZE, "prefill", *pool, "--tp-size", "2",
            env={**STAGED, "SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
        ),
    ]  # fmt: skip
    with servers_running(specs, server_logs) as servers:
        yield Deployment(servers, flag)


@pytest.fixture(scope="module")
def reference(deployment) -> dict[tuple[int, ...], tuple[int, ...]]:
    url = deployment.servers["plain"].url
    prompts = [*PROMPTS, CONTROL_PROMPT]
    generations = generate_all(lambda ids: generate(url, ids), prompts, CONCURRENCY)
    return {tuple(p): g.output_ids for p, g in zip(prompts, generations, strict=True)}


@pytest.fixture(scope="module")
def generations(deployment, reference) -> dict[str, list[Generation]]:
    return {
        "staged": deployment.send("staged-prefill", PROMPTS),
        "plain prefill": deployment.send("plain-prefill", PROMPTS),
        "plain decode": deployment.send("staged-prefill-2", PROMPTS, decode="plain-decode"),
        "tp2": deployment.send("tp2-prefill", TP2_PROMPTS),
    }


def staged_sends(url: str) -> float:
    metrics = server_metrics(url)
    return sum(value for key, value in metrics.items() if "hook=staged" in key)


def test_staged_tokens_equal_a_plain_servers(generations, reference):
    assert_same_tokens("staged", PROMPTS, generations["staged"], reference)


def test_staged_sends_and_scatters_are_counted(deployment, generations):
    prefill = server_metrics(deployment.servers["staged-prefill"].url)
    staged = sum(value for key, value in prefill.items() if "hook=staged" in key)
    assert staged >= len(PROMPTS), prefill
    decode = server_metrics(deployment.servers["decode"].url)
    assert decode["gpu_planner:staged_scatters_total"] >= staged, decode
    refused = [key for key in decode if key.startswith("gpu_planner:receive_staging_fallbacks")]
    assert not [key for key in refused if "refused" in key], decode


def test_mixed_deployments_keep_todays_protocol(deployment, generations, reference):
    assert_same_tokens("plain prefill", PROMPTS, generations["plain prefill"], reference)
    assert_same_tokens("plain decode", PROMPTS, generations["plain decode"], reference)
    assert server_metrics(deployment.servers["plain-prefill"].url) == {}
    assert staged_sends(deployment.servers["staged-prefill-2"].url) == 0
    assert server_metrics(deployment.servers["plain-decode"].url) == {}


def test_tp_down_staged_tokens_equal_a_plain_servers(deployment, generations, reference):
    assert_same_tokens("TP 2 -> 1", TP2_PROMPTS, generations["tp2"], reference)
    assert staged_sends(deployment.servers["tp2-prefill"].url) >= len(TP2_PROMPTS)


def test_a_skipped_scatter_changes_the_tokens(deployment, generations, reference):
    """The control: one staged page never scattered, other tokens; the next request is right."""
    expected = reference[tuple(CONTROL_PROMPT)]
    deployment.corrupt_flag.touch()
    [corrupted] = deployment.send("staged-prefill", [CONTROL_PROMPT])
    assert not deployment.corrupt_flag.exists(), "the scaffolding did not take the flag"
    assert corrupted.output_ids[0] == expected[0]  # the prefill's own token
    assert corrupted.output_ids[1:] != expected[1:]
    [clean] = deployment.send("staged-prefill", [CONTROL_PROMPT])
    assert clean.output_ids == expected

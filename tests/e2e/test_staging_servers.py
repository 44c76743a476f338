"""Receive staging in real sglang servers: a 16-layer model, page 16, fragmented pools.

A decode server with the plugin (its receive staging on) and two prefill
servers sending to it:

- `staged-prefill` (plugin, staging gate at 1 descriptor): fragmented sends
  of 32 KV buffers are gathered into the decode's region and scattered there:
  the tokens must equal a plain server's, and `/metrics` must show staged
  sends (prefill) and scatters (decode), no chunk refused.
- `plain-prefill` (`GPU_PLANNER_DISABLE=1`) to the plugin decode: a mixed
  deployment, today's protocol, identical tokens, nothing staged.

The corruption control leaves one staged page out of one scatter on the
decode (test scaffolding): the tokens must change, and the next request is
right again. TP-down and a plain decode: `test_staging_servers_tp_down.py`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.e2e.e2e_checks import assert_same_tokens
from tests.e2e.e2e_client import Generation, generate_all, generate_pd, server_metrics
from tests.e2e.e2e_scenarios import (
    CONCURRENCY,
    POOL_TOKENS,
    STAGING_CONTROL_PROMPT,
    STAGING_PROMPTS,
    prefill_spec,
)
from tests.e2e.e2e_servers import Server, servers_running, sglang_spec
from tests.e2e.scaffolding.e2e_sglang_scaffolding import CORRUPT_SCATTER_FLAG_ENV

pytestmark = pytest.mark.e2e

PAGE_SIZE = 16
BATCH_PAGES = 1024  # sglang's default: staging, not batch cuts, is what this module checks
PROMPTS = STAGING_PROMPTS[:-1]  # 12 mixed prompts (5 to 333 tokens); the last is the control
STAGED = {"GPU_PLANNER_STAGING_MIN_DESCRIPTORS": "1"}


def staged_sends(url: str) -> float:
    """`gpu_planner:sends_total{hook=staged}` on a server's /metrics."""
    return sum(value for key, value in server_metrics(url).items() if "hook=staged" in key)


@dataclasses.dataclass
class Deployment:
    decode: Server
    staged: Server
    plain: Server
    corrupt_flag: Path  # create it to corrupt the decode's next scatter

    def send(self, prefill: Server, prompts) -> list[Generation]:
        def one(ids):
            return generate_pd(prefill.url, prefill.bootstrap_port, self.decode.url, ids)

        return generate_all(one, prompts, CONCURRENCY)


@pytest.fixture(scope="module")
def deployment(layered_model, layered_reference_tokens, server_logs, tmp_path_factory):
    flag = tmp_path_factory.mktemp("scatter-control") / "corrupt-next-scatter"
    specs = [
        sglang_spec(
            "staging-decode", layered_model, PAGE_SIZE, "decode",
            "--max-total-tokens", str(POOL_TOKENS), env={CORRUPT_SCATTER_FLAG_ENV: str(flag)},
        ),
        prefill_spec("staged-prefill", layered_model, PAGE_SIZE, BATCH_PAGES, STAGED),
        prefill_spec(
            "plain-prefill", layered_model, PAGE_SIZE, BATCH_PAGES, {"GPU_PLANNER_DISABLE": "1"}
        ),
    ]  # fmt: skip
    with servers_running(specs, server_logs) as servers:
        yield Deployment(
            servers["staging-decode"], servers["staged-prefill"], servers["plain-prefill"], flag
        )


@pytest.fixture(scope="module")
def generations(deployment) -> dict[str, list[Generation]]:
    return {
        "staged": deployment.send(deployment.staged, PROMPTS),
        "plain prefill": deployment.send(deployment.plain, PROMPTS),
    }


def test_staged_tokens_equal_a_plain_servers(generations, layered_reference_tokens):
    assert_same_tokens("staged", PROMPTS, generations["staged"], layered_reference_tokens)


def test_staged_sends_and_scatters_are_counted(deployment, generations):
    staged = staged_sends(deployment.staged.url)
    assert staged >= len(PROMPTS)
    decode = server_metrics(deployment.decode.url)
    assert decode["gpu_planner:staged_scatters_total"] >= staged, decode
    assert not [key for key in decode if "refused" in key], decode


def test_a_plain_prefill_to_a_staging_decode_keeps_todays_protocol(
    deployment, generations, layered_reference_tokens
):
    tokens = generations["plain prefill"]
    assert_same_tokens("plain prefill", PROMPTS, tokens, layered_reference_tokens)
    assert server_metrics(deployment.plain.url) == {}


def test_a_skipped_scatter_changes_the_tokens(deployment, generations, layered_reference_tokens):
    """The control: one staged page never scattered, other tokens; the next request is right."""
    expected = layered_reference_tokens[tuple(STAGING_CONTROL_PROMPT)]
    deployment.corrupt_flag.touch()
    [corrupted] = deployment.send(deployment.staged, [STAGING_CONTROL_PROMPT])
    assert not deployment.corrupt_flag.exists(), "the scaffolding did not take the flag"
    assert corrupted.output_ids[0] == expected[0]  # the prefill's own token
    assert corrupted.output_ids[1:] != expected[1:]
    [clean] = deployment.send(deployment.staged, [STAGING_CONTROL_PROMPT])
    assert clean.output_ids == expected

"""Page size 1, Mooncake 0.3.13 (list hand-off), requests through the `smg` PD router.

Every server imports Mooncake 0.3.13 (`MOONCAKE_0_3_13`, ahead of the venv's
0.3.14 on PYTHONPATH), whose engine has no `*_arrays` methods, so the plugin
hands sglang's `MooncakeTransferEngine.batch_transfer_sync` the same Python
lists that sglang builds: the path every Mooncake <= 0.3.13 user takes. At page
size 1 every token is a page, so a fragmented pool gives long run lists.

A second prefill, at page size 16 with the plugin (Mooncake 0.3.13 too), sends
straight to the same page-1 decode (not through the router): a pair sglang
alone refuses, which the plugin serves (each chunk planned token by token on
both sides). Its tokens must be the plain server's, prefix-cache hits
included, and the mapping control must change them. A third prefill, at page
size 16 with `GPU_PLANNER_DISABLE=1` (plain sglang), sends to the decode too:
sglang's prefill cannot address the decode's pages, writes none, and the
decode fails the request, naming both page sizes.
"""

from __future__ import annotations

import functools

import pytest

from bench.servers.client import generate, generate_all, generate_pd
from bench.servers.launcher import router_spec, servers_running
from tests.e2e.e2e_checks import (
    assert_cache_hits,
    assert_mismapped_then_right,
    assert_plain_prefill_fails,
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
    MOONCAKE_0_3_13,
    decode_spec,
    prefill_spec,
)
from tests.e2e.scaffolding.e2e_sglang_scaffolding import MISMAP_PAGES_FLAG_ENV

pytestmark = pytest.mark.e2e

PAGE_SIZE = 1
BATCH_PAGES = 64
REPAGED_PAGE_SIZE = 16  # the second prefill's: the decode's is PAGE_SIZE


@pytest.fixture(scope="module")
def mismap_flag(tmp_path_factory):
    """Create it to mismap the page-16 prefill's next later chunk (the mapping control)."""
    return tmp_path_factory.mktemp("control") / "mismap-next-chunk"


@pytest.fixture(scope="module")
def servers(tiny_model, server_logs, mismap_flag, reference_tokens):
    """The decode, three prefills and the router; the plain reference server
    (`reference_tokens`) runs before them, alone."""
    if not (MOONCAKE_0_3_13 / "mooncake" / "engine.so").exists():
        raise FileNotFoundError(
            f"no Mooncake 0.3.13 in {MOONCAKE_0_3_13}: run scripts/setup.sh test"
        )
    old_mooncake = (str(MOONCAKE_0_3_13),)
    specs = [
        decode_spec("p1-decode", tiny_model, PAGE_SIZE, BATCH_PAGES, old_mooncake),
        prefill_spec("p1-prefill", tiny_model, PAGE_SIZE, BATCH_PAGES, python_path=old_mooncake),
        prefill_spec(
            "p16-prefill",
            tiny_model,
            REPAGED_PAGE_SIZE,
            BATCH_PAGES,
            {MISMAP_PAGES_FLAG_ENV: str(mismap_flag)},
            python_path=old_mooncake,
        ),
        prefill_spec(
            "p16-prefill-disabled",
            tiny_model,
            REPAGED_PAGE_SIZE,
            BATCH_PAGES,
            {"GPU_PLANNER_DISABLE": "1"},
            python_path=old_mooncake,
        ),
    ]
    with servers_running(specs, server_logs) as pd:
        router = router_spec([pd["p1-prefill"]], pd["p1-decode"])
        with servers_running([router], server_logs) as routed:
            yield {**pd, **routed}


@pytest.fixture(scope="module")
def generations(servers):
    url = servers["router"].url
    return generate_all(lambda ids: generate(url, ids), MIXED_PROMPTS, CONCURRENCY)


def test_tokens_through_the_router_equal_a_plain_server(generations, reference_tokens):
    assert_same_tokens("router", MIXED_PROMPTS, generations, reference_tokens)


def test_plugin_handed_lists_to_mooncake_0_3_13(servers, server_logs, generations):
    prefill = servers["p1-prefill"]
    metrics = plugin_metrics(prefill.url, "lists", server_logs / "p1-metrics.json")
    assert "Mooncake write hand-off through lists" in prefill.log_path.read_text()
    assert "(Mooncake < 0.3.14)" in prefill.log_path.read_text()
    assert metrics["gpu_planner:fragmented_sends_total"] > 0, "no page list broke"
    assert sends_above(metrics, 4) > 0, (
        f"no send above 4 runs per buffer: {runs_histogram(metrics)}"
    )
    assert metrics["gpu_planner:batch_cuts_total"] > 0


def _send_repaged(servers, ids):
    prefill, decode = servers["p16-prefill"], servers["p1-decode"]
    return generate_pd(prefill.url, prefill.bootstrap_port, decode.url, ids)


@pytest.fixture(scope="module")
def repaged(servers):
    """The mixed prompts through the page-16 prefill to the page-1 decode."""
    return generate_all(functools.partial(_send_repaged, servers), MIXED_PROMPTS, CONCURRENCY)


def test_page16_prefill_to_page1_decode_equals_a_plain_server(
    servers, server_logs, repaged, reference_tokens
):
    """Prefill page 16 -> decode page 1 (sglang refuses the pair), Mooncake 0.3.13's lists: the
    plain server's tokens, prefix-cache hits included, every chunk planned by the plugin."""
    assert_same_tokens("page 16 -> 1", MIXED_PROMPTS, repaged, reference_tokens)
    assert_cache_hits(repaged)
    record = server_logs / "p16-to-p1-metrics.json"
    assert_repaged_sends(servers["p16-prefill"].url, "lists", record, MIXED_PROMPTS)


def test_a_wrong_page_mapping_changes_the_tokens(servers, mismap_flag, repaged, reference_tokens):
    """The mapping control on the page-16 prefill: other tokens, then right again."""
    send = functools.partial(_send_repaged, servers)
    assert_mismapped_then_right(send, mismap_flag, CONTROL_PROMPT, reference_tokens)


def test_a_plain_sglang_prefill_of_another_page_size_fails_its_request(servers, reference_tokens):
    """Plain sglang at page 16 -> the plugin decode at page 1: the request fails, naming both
    page sizes; the decode serves the same prompt right from the plugin prefill next."""
    prompt = MIXED_PROMPTS[12]  # 410 tokens: two chunks
    pages = (REPAGED_PAGE_SIZE, PAGE_SIZE)
    assert_plain_prefill_fails(servers["p16-prefill-disabled"], servers["p1-decode"], prompt, pages)
    assert _send_repaged(servers, prompt).output_ids == reference_tokens[tuple(prompt)]

"""Page size 1, Mooncake 0.3.13 (list hand-off), requests through the `smg` PD router.

Both servers import Mooncake 0.3.13 (`MOONCAKE_0_3_13`, ahead of the venv's
0.3.14 on PYTHONPATH), whose engine has no `*_arrays` methods, so the plugin
hands sglang's `MooncakeTransferEngine.batch_transfer_sync` the same Python
lists that sglang builds: the path every Mooncake <= 0.3.13 user takes. At page
size 1 every token is a page, so a fragmented pool gives long run lists.
"""

from __future__ import annotations

import pytest

from bench.servers.client import generate, generate_all
from bench.servers.launcher import router_spec, servers_running
from tests.e2e.e2e_checks import assert_same_tokens, plugin_metrics, runs_histogram, sends_above
from tests.e2e.e2e_scenarios import (
    CONCURRENCY,
    MIXED_PROMPTS,
    MOONCAKE_0_3_13,
    decode_spec,
    prefill_spec,
)

pytestmark = pytest.mark.e2e

PAGE_SIZE = 1
BATCH_PAGES = 64


@pytest.fixture(scope="module")
def servers(tiny_model, server_logs):
    if not (MOONCAKE_0_3_13 / "mooncake" / "engine.so").exists():
        raise FileNotFoundError(
            f"no Mooncake 0.3.13 in {MOONCAKE_0_3_13}: run scripts/setup.sh test"
        )
    old_mooncake = (str(MOONCAKE_0_3_13),)
    specs = [
        decode_spec("p1-decode", tiny_model, PAGE_SIZE, BATCH_PAGES, old_mooncake),
        prefill_spec("p1-prefill", tiny_model, PAGE_SIZE, BATCH_PAGES, python_path=old_mooncake),
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

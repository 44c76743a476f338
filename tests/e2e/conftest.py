"""Fixtures of the e2e suite: the tiny model, the server log folder, the plain-server reference.

The suite starts real sglang servers (see `bench.servers.launcher`); each test
module holds one deployment for its tests and stops it at the module's end, so
at most one deployment runs at a time (and across suites on one machine, the
launcher's lock). The suite's test-only controls (`scaffolding/`) reach every
server it starts through the PYTHONPATH it inherits. A failing test's report
names the folder that keeps every server's log.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.servers.client import generate, generate_all
from bench.servers.launcher import servers_running, sglang_spec
from bench.servers.tiny_model import write_tiny_llama
from tests.e2e.e2e_scenarios import ALL_PROMPTS, CONCURRENCY

LOG_DIR_KEY = pytest.StashKey[Path]()
TEST_SCAFFOLDING = Path(__file__).resolve().parent / "scaffolding"


@pytest.fixture(scope="package", autouse=True)
def scaffolding_on_server_path():
    """Put the test-only sglang plugin (`scaffolding/`) on the servers' PYTHONPATH while the
    e2e tests run (the launcher passes its own PYTHONPATH on to every server)."""
    path = os.pathsep.join(filter(None, [str(TEST_SCAFFOLDING), os.environ.get("PYTHONPATH")]))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", path)
        yield


@pytest.fixture(scope="session")
def server_logs(request, tmp_path_factory) -> Path:
    """The folder of every server's log (kept after the run)."""
    folder = tmp_path_factory.mktemp("e2e-server-logs")
    request.config.stash[LOG_DIR_KEY] = folder
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def reference_tokens(tiny_model, server_logs) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Greedy tokens of every e2e prompt from a plain (not disaggregated) sglang server."""
    spec = sglang_spec("plain", tiny_model, 16, "plain", "--max-total-tokens", "4096")
    with servers_running([spec], server_logs) as servers:
        url = servers["plain"].url
        generations = generate_all(lambda ids: generate(url, ids), ALL_PROMPTS, CONCURRENCY)
    return {tuple(p): g.output_ids for p, g in zip(ALL_PROMPTS, generations, strict=True)}


@pytest.fixture(scope="session")
def layered_model(tmp_path_factory) -> Path:
    """The tiny Llama with 16 layers (32 KV buffers): the receive-staging modules' model."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-16"), seed=1, layers=16)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Name the server log folder in the report of a failing e2e test."""
    report = yield
    folder = item.config.stash.get(LOG_DIR_KEY, None)
    if report.failed and folder is not None:
        report.sections.append(("e2e server logs", str(folder)))
    return report

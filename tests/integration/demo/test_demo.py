"""The two-process demo end to end, push and pull: real Mooncake transfers, every byte verified.

Also: a failing engine call still ends both processes cleanly.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
from demo_support import small_config

from gpu_planner import settings
from gpu_planner.integration.demo import run
from gpu_planner.integration.demo.run import DemoReport, Verification, format_report, run_demo
from gpu_planner.integration.demo.sides import Planned
from gpu_planner.plan import PlanPiece

SCENARIOS = {
    "host-only-batch-7": small_config(device_fraction=0.0, max_batch_pages=7),
    "mixed-no-cut-reference": small_config(max_batch_pages=0, planner="reference"),
    "mixed-batch-7-per-buffer": small_config(max_batch_pages=7, buffer_workers=3),
    "mixed-batch-1024": small_config(tokens=2100, page_size=1, item_len=64, max_batch_pages=1024),
    "empty-request": small_config(tokens=0),
}


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("config", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_demo_moves_and_verifies_every_byte(config, mode):
    config = dataclasses.replace(config, mode=mode)
    report = run_demo(config)
    assert report.ok, format_report(report)
    pages = config.num_pages
    assert report.pages == pages
    assert report.total_bytes == pages * config.item_len * config.buffers
    if pages:
        batches = -(-pages // config.max_batch_pages) if config.max_batch_pages else 1
        assert batches <= report.host_runs <= pages
        assert report.device_runs == 0 if not any(config.is_device) else report.device_runs >= 1
        assert report.descriptors >= config.buffers * batches
    else:
        assert (report.host_runs, report.device_runs, report.descriptors) == (0, 0, 0)
    pool_pages = [
        config.pool_pages(config.device_pool_factor if on else config.host_pool_factor)
        for on in config.is_device
    ]
    assert report.verification.pages_checked == sum(pool_pages)
    assert report.verification.bytes_checked == sum(pool_pages) * config.item_len


def test_a_report_with_a_wrong_page_is_not_ok():
    report = DemoReport(small_config(), verification=Verification(10, 1, 0, 1280))
    assert not report.ok
    assert "MISMATCH" in format_report(report)


def _cli(*arguments: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gpu_planner.cli", "demo", *arguments]
    env = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


def test_cli_demo_prints_the_table_and_exits_zero():
    # Pull here: run_demo covers push, the default, in every scenario above.
    result = _cli(
        *("--buffers", "4", "--tokens", "256", "--page-size", "8", "--item-len", "64"),
        *("--max-batch-pages", "5", "--planner", "gpu", "--mode", "pull", "--seed", "3"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^mode / planner\s+pull / gpu_planner \(\w+\) on decode", result.stdout, re.M)
    for row in ("pages", "runs host / device", "descriptors", "plan time", "submit time"):
        assert row in result.stdout
    assert re.search(r"^verification\s+OK", result.stdout, re.MULTILINE)


def test_cli_demo_rejects_a_bad_configuration():
    result = _cli("--item-len", "12", "--timeout-s", "5")
    assert result.returncode != 0
    assert "item_len" in result.stderr


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_an_engine_exception_ends_both_sides_cleanly(mode, monkeypatch):
    # The planning side's last batch names an address Mooncake's binding refuses (a Python int
    # >= 2**64, lists hand-off): the engine raises TypeError. The demo must report a
    # TransferError, tell the peer, and the peer must verify and exit 0.
    monkeypatch.setenv(settings.HANDOFF.name, "lists")
    plan_request = run.plan_request

    def plan_with_an_unreachable_batch(*args, **kwargs) -> Planned:
        planned = plan_request(*args, **kwargs)
        batch, _, srcs, dsts, lens = planned.work[-1]
        planned.work.append(PlanPiece(batch + 1, None, srcs, [2**64 + dst for dst in dsts], lens))
        return planned

    monkeypatch.setattr(run, "plan_request", plan_with_an_unreachable_batch)
    config = small_config(mode=mode, timeout_s=20.0)
    report = run_demo(config)
    assert not report.ok
    (error,) = report.errors  # the peer exited 0: no "peer process exited" error
    batches = -(-config.num_pages // config.max_batch_pages)
    assert re.match(rf"TransferError: Mooncake batch {batches} .* TypeError", error)
    assert report.verification is not None  # both sides ran to the end


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), 1e10, 0.0, -1.0])
def test_an_unbounded_or_invalid_timeout_is_refused_before_anything_starts(timeout_s):
    with pytest.raises(ValueError, match="timeout_s"):
        dataclasses.replace(small_config(), timeout_s=timeout_s)

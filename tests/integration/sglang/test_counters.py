"""The plugin's counters: in-process snapshot, one DEBUG line per send, and the prometheus export.

The export is read the way sglang's `/metrics` reads it: a process that sends
writes into PROMETHEUS_MULTIPROC_DIR, and another collects that folder with
`prometheus_client.multiprocess.MultiProcessCollector`. The hooks' calls are
checked end to end on real servers (tests/e2e).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from prometheus_client import CollectorRegistry, generate_latest, multiprocess

from gpu_planner.integration.sglang import counters
from gpu_planner.integration.sglang.fallback import log_fallback_once

SEND = ("generic", "arrays", 40, 4096, 0.002, 4, 3)  # 10 runs per buffer, 2 batch cuts


def test_snapshot_counts_sends_and_logs_one_debug_line_each(caplog):
    before = counters.snapshot()
    with caplog.at_level(logging.DEBUG, logger="gpu_planner.integration.sglang.counters"):
        counters.record_send(*SEND)
        counters.record_send("slice", "lists", 8, 64, 0.001, 2)
    after = counters.snapshot()
    assert after["sends"].get("generic/arrays", 0) == before["sends"].get("generic/arrays", 0) + 1
    assert after["sends"].get("slice/lists", 0) == before["sends"].get("slice/lists", 0) + 1
    assert after["descriptors"] - before["descriptors"] == 48
    assert after["bytes"] - before["bytes"] == 4160
    assert after["batch_cuts"] - before["batch_cuts"] == 2
    assert after["fragmented_sends"] - before["fragmented_sends"] == 1  # 10 runs > 3 batches
    assert after["max_runs_per_buffer"] >= 10
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(lines) == 2
    assert "generic send, 40 descriptors (10 runs per buffer, 4 buffers, 3 batches)" in lines[0]


def test_every_fallback_is_counted_but_logged_once(caplog):
    before = counters.snapshot()["fallbacks"].get("counter test", 0)
    with caplog.at_level(logging.INFO, logger="gpu_planner.integration.sglang.plugin"):
        for _ in range(3):
            log_fallback_once("a reason the counter test gives", key="counter test")
    assert counters.snapshot()["fallbacks"]["counter test"] == before + 3
    assert caplog.text.count("a reason the counter test gives") == 1


def test_a_send_that_is_not_staged_is_counted_and_logged_as_going_direct(caplog):
    """It stays the hook's send: the log says it goes direct, not back to sglang's code."""
    from gpu_planner.integration.sglang import staged_send

    key = "not staged: a reason the counter test gives"
    before = counters.snapshot()["fallbacks"].get(key, 0)
    with caplog.at_level(logging.INFO, logger="gpu_planner.integration.sglang.plugin"):
        for _ in range(2):
            assert staged_send._not_staged("a reason the counter test gives") is None
    assert counters.snapshot()["fallbacks"][key] == before + 2
    assert caplog.messages == [
        "gpu_planner: a send goes direct, not staged: a reason the counter test gives"
    ]


def test_metrics_reach_another_process_through_the_multiprocess_folder(tmp_path):
    sender = (
        "from gpu_planner.integration.sglang import counters\n"
        f"counters.record_send(*{SEND!r})\n"
        "counters.record_fallback('pages')\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", sender], env=env, check=True, timeout=120)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    exposition = generate_latest(registry).decode()
    assert 'gpu_planner:sends_total{handoff="arrays",hook="generic"} 1.0' in exposition
    assert 'gpu_planner:fallbacks_total{reason="pages"} 1.0' in exposition
    assert "gpu_planner:descriptors_total 40.0" in exposition
    assert "gpu_planner:batch_cuts_total 2.0" in exposition
    assert "gpu_planner:fragmented_sends_total 1.0" in exposition
    assert 'gpu_planner:runs_per_buffer_bucket{le="8.0"} 0.0' in exposition
    assert 'gpu_planner:runs_per_buffer_bucket{le="16.0"} 1.0' in exposition

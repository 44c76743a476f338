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

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest, multiprocess

from gpu_planner.integration.sglang import counters, fallback
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


def test_a_sends_path_is_counted_per_send_and_its_reason_logged_once(caplog, monkeypatch):
    """A send toward a staging decode whose buffers cannot be staged stays the hook's send:
    counted under its path and reason every time, logged once as going direct, never as a
    fallback to sglang's code."""
    from gpu_planner.integration.sglang import send_path, staged_send
    from gpu_planner.integration.sglang.prefill_routes import ROUTES
    from gpu_planner.integration.sglang.staging_wire import Capability

    monkeypatch.setattr(fallback, "_logged_keys", set())  # logged once per process
    key = f"{send_path.DIRECT}/{staged_send.NOT_ONE_SHARE}"
    pages = np.arange(4)
    before = counters.snapshot()
    ROUTES.advertised("counter-test", Capability(address=1 << 40, nbytes=1 << 20))
    try:
        with caplog.at_level(logging.INFO, logger="gpu_planner.integration.sglang.plugin"):
            for _ in range(2):
                decision = send_path.generic_path(
                    None, "counter-test", pages, pages, staged_send.NOT_ONE_SHARE, 4
                )
                assert (decision.path, decision.lease) == (send_path.DIRECT, None)
    finally:
        ROUTES.advertised("counter-test", None)
    after = counters.snapshot()
    assert after["paths_chosen"][key] == before["paths_chosen"].get(key, 0) + 2
    assert after["fallbacks"] == before["fallbacks"]
    assert caplog.messages == [f"gpu_planner: a send goes direct: {staged_send.NOT_ONE_SHARE}"]


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

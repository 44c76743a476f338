"""What the sglang plugin did, counted per process: sends, fallbacks, descriptors, bytes, plan time.

The hooks call `record_send` once per hooked send and the fallback logger
calls `record_fallback` every time a call goes back to sglang's own code.
`snapshot()` returns the counts of this process (a test or a debugger reads
them in the process that sent). Each send is also logged at DEBUG, one line.

sglang runs its scheduler, and so the sends, in separate processes. With
`--enable-metrics`, sglang's launcher sets `PROMETHEUS_MULTIPROC_DIR` before it
starts them and serves every process's `prometheus_client` metrics from that
folder on `/metrics`. When that variable is set the counts are also kept as
`prometheus_client` metrics named `gpu_planner:*`, so they appear beside
sglang's own `sglang:*` series:

- `gpu_planner:sends_total{hook, handoff}`: hooked sends by hook (`generic`,
  `slice`, `gathered`, `staged`: written through the decode's receive
  staging) and Mooncake hand-off (`arrays`, `lists`);
- `gpu_planner:fallbacks_total{reason}`: calls handed back to sglang's code;
- `gpu_planner:failed_sends_total{reason}`: hooked sends that failed after
  their first engine call (sglang got -1), by what failed;
- `gpu_planner:descriptors_total`, `gpu_planner:bytes_total`: what the sends
  handed to Mooncake;
- `gpu_planner:plan_seconds_total`: time spent planning (before the first
  engine call);
- `gpu_planner:batch_cuts_total`: batch cuts (`max_transfer_batch_indices`), one
  fewer than the batches of each send;
- `gpu_planner:runs_per_buffer` (histogram): descriptors per buffer of each
  generic send, that is its runs per KV buffer, batch cuts included (1 when
  both page lists are contiguous and no cut falls inside them);
- `gpu_planner:fragmented_sends_total`: generic sends whose page lists break
  (a batch holds two or more runs of a buffer), batch cuts aside;
- `gpu_planner:staged_scatters_total` (decode): staged chunks scattered into
  the decode's pages; `gpu_planner:receive_staging_fallbacks_total{reason}`
  (decode): requests or chunks that could not use the receive staging (no
  room in the region, a rejected chunk), by reason;
- `gpu_planner:paths_chosen_total{path, reason}`: every hooked send's path
  (`send_path`: `direct`, `staged`, `gathered`, `per-token`), once per send,
  and why (a fixed set of reasons: the decode offers no staging, the cost
  model's price, a probe, the override gate, no free send slot, ...); a path's
  count equals its hook's `sends_total` (direct: `generic`, per-token: `slice`);
- `gpu_planner:send_slots_held_total` (prefill): send slots never lent again
  because a write that read them did not end cleanly (`send_slots`);
- `gpu_planner:path_predicted_seconds_total{path}`,
  `gpu_planner:path_observed_seconds_total{path}` and
  `gpu_planner:path_observed_sends_total{path}`: for each completed send the
  model learned from, what it priced the prefill's part at and what it took;
  `gpu_planner:path_observed_over_predicted{path}` (histogram): their ratio.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any

logger = logging.getLogger(__name__)

RUNS_PER_BUFFER_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
OBSERVED_OVER_PREDICTED_BUCKETS = (0.25, 0.5, 0.8, 0.9, 1.1, 1.25, 2.0, 4.0, 16.0)

_lock = threading.Lock()
_sends: collections.Counter[tuple[str, str]] = collections.Counter()
_fallbacks: collections.Counter[str] = collections.Counter()
_failures: collections.Counter[str] = collections.Counter()
_receive_fallbacks: collections.Counter[str] = collections.Counter()
_totals: collections.Counter[str] = collections.Counter()
_path_choices: collections.Counter[tuple[str, str]] = collections.Counter()
_path_times: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
_max_runs_per_buffer = 0
_prometheus: dict[str, Any] | None = None
_metrics_unexported = False  # it sends without PROMETHEUS_MULTIPROC_DIR: no metrics to export


def record_send(
    hook: str,
    handoff: str,
    descriptors: int,
    nbytes: int,
    plan_seconds: float,
    buffers: int,
    batches: int = 1,
) -> None:
    """Count one hooked send: `descriptors` over `buffers` KV buffers, in `batches` batches."""
    global _max_runs_per_buffer
    runs_per_buffer = -(-descriptors // buffers) if buffers else 0
    fragmented = hook == "generic" and descriptors > buffers * batches
    with _lock:
        _sends[hook, handoff] += 1
        _totals["descriptors"] += descriptors
        _totals["bytes"] += nbytes
        _totals["plan_seconds"] += plan_seconds
        _totals["batch_cuts"] += max(batches - 1, 0)
        _totals["fragmented_sends"] += fragmented
        _max_runs_per_buffer = max(_max_runs_per_buffer, runs_per_buffer)
    logger.debug(
        "gpu_planner: %s send, %d descriptors (%d runs per buffer, %d buffers, %d batches), "
        "%d bytes, planned in %.3f ms, %s hand-off",
        hook,
        descriptors,
        runs_per_buffer,
        buffers,
        batches,
        nbytes,
        plan_seconds * 1e3,
        handoff,
    )
    metrics = _prometheus_metrics()
    if metrics is not None:
        metrics["sends"].labels(hook=hook, handoff=handoff).inc()
        metrics["descriptors"].inc(descriptors)
        metrics["bytes"].inc(nbytes)
        metrics["plan_seconds"].inc(plan_seconds)
        metrics["batch_cuts"].inc(max(batches - 1, 0))
        metrics["fragmented_sends"].inc(fragmented)
        if hook == "generic":
            metrics["runs_per_buffer"].observe(runs_per_buffer)


def record_fallback(reason: str) -> None:
    """Count one call handed back to sglang's own code, by `reason` (the fallback log's key)."""
    _count_by_reason(_fallbacks, "fallbacks", reason)


def record_failure(reason: str) -> None:
    """Count one hooked send that failed after an engine call had started, by `reason`."""
    _count_by_reason(_failures, "failed_sends", reason)


def record_scatter(chunks: int = 1) -> None:
    """Count staged chunks the decode scattered into its pages."""
    with _lock:
        _totals["staged_scatters"] += chunks
    metrics = _prometheus_metrics()
    if metrics is not None:
        metrics["staged_scatters"].inc(chunks)


def record_receive_fallback(reason: str) -> None:
    """Count, on decode, a request or chunk that did not go through the receive staging."""
    _count_by_reason(_receive_fallbacks, "receive_staging_fallbacks", reason)


def record_path_choice(path: str, reason: str) -> None:
    """Count one send-path choice of the cost model: `path` (direct, staged) and why."""
    with _lock:
        _path_choices[path, reason] += 1
    metrics = _prometheus_metrics()
    if metrics is not None:
        metrics["paths_chosen"].labels(path=path, reason=reason).inc()


def record_held_slot() -> None:
    """Count one send slot held for good: a write that did not end cleanly may still read it."""
    with _lock:
        _totals["send_slots_held"] += 1
    metrics = _prometheus_metrics()
    if metrics is not None:
        metrics["send_slots_held"].inc()


def record_path_time(path: str, predicted_s: float, observed_s: float) -> None:
    """Count one completed send on `path`: the model's price for it and the time it took."""
    with _lock:
        times = _path_times[path]
        times["sends"] += 1
        times["predicted_seconds"] += predicted_s
        times["observed_seconds"] += observed_s
    metrics = _prometheus_metrics()
    if metrics is not None:
        metrics["path_observed_sends"].labels(path=path).inc()
        metrics["path_predicted_seconds"].labels(path=path).inc(predicted_s)
        metrics["path_observed_seconds"].labels(path=path).inc(observed_s)
        ratio = observed_s / predicted_s if predicted_s > 0 else float("inf")
        metrics["path_observed_over_predicted"].labels(path=path).observe(ratio)


def _count_by_reason(counts: collections.Counter[str], metric: str, reason: str) -> None:
    with _lock:
        counts[reason] += 1
    metrics = _prometheus_metrics()
    if metrics is not None:
        metrics[metric].labels(reason=reason).inc()


def snapshot() -> dict[str, Any]:
    """This process's counts: a new dict of plain values, safe to keep and compare."""
    with _lock:
        return {
            "sends": {f"{hook}/{handoff}": count for (hook, handoff), count in _sends.items()},
            "fallbacks": dict(_fallbacks),
            "failed_sends": dict(_failures),
            "receive_staging_fallbacks": dict(_receive_fallbacks),
            "staged_scatters": _totals["staged_scatters"],
            "send_slots_held": _totals["send_slots_held"],
            "descriptors": _totals["descriptors"],
            "bytes": _totals["bytes"],
            "plan_seconds": _totals["plan_seconds"],
            "batch_cuts": _totals["batch_cuts"],
            "fragmented_sends": _totals["fragmented_sends"],
            "max_runs_per_buffer": _max_runs_per_buffer,
            "paths_chosen": {f"{path}/{why}": n for (path, why), n in _path_choices.items()},
            "path_times": {path: dict(times) for path, times in _path_times.items()},
        }


def _prometheus_metrics() -> dict[str, Any] | None:
    """The `gpu_planner:*` metrics when sglang exports them (PROMETHEUS_MULTIPROC_DIR), else None.

    Created on first use, in the process that sends: prometheus_client reads
    the variable when it is first imported, and sglang sets it before it starts
    its scheduler processes.
    """
    global _prometheus, _metrics_unexported
    if _prometheus is not None or _metrics_unexported:
        return _prometheus
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        # Settled once this process sends: a scheduler has sglang's variable from its start.
        # Reading os.environ for a name it lacks raises and catches a KeyError, ~1 us per
        # send hot and tens of us after a transfer left the caches cold.
        _metrics_unexported = bool(_sends)  # this process recorded a send
        return None
    with _lock:
        if _prometheus is None:
            from prometheus_client import Counter, Histogram

            _prometheus = {
                "sends": Counter(
                    "gpu_planner:sends", "Sends planned by gpu_planner", ["hook", "handoff"]
                ),
                "fallbacks": Counter(
                    "gpu_planner:fallbacks", "Calls handed back to sglang's code", ["reason"]
                ),
                "failed_sends": Counter(
                    "gpu_planner:failed_sends",
                    "Hooked sends that failed after their first engine call",
                    ["reason"],
                ),
                "receive_staging_fallbacks": Counter(
                    "gpu_planner:receive_staging_fallbacks",
                    "Decode requests or chunks that did not use the receive staging",
                    ["reason"],
                ),
                "staged_scatters": Counter(
                    "gpu_planner:staged_scatters", "Staged chunks scattered into decode pages"
                ),
                "send_slots_held": Counter(
                    "gpu_planner:send_slots_held",
                    "Send slots held for good: a write that did not end cleanly may read them",
                ),
                "descriptors": Counter("gpu_planner:descriptors", "Descriptors handed to Mooncake"),
                "bytes": Counter(
                    "gpu_planner:bytes", "Bytes of the descriptors handed to Mooncake"
                ),
                "plan_seconds": Counter("gpu_planner:plan_seconds", "Time spent planning sends"),
                "batch_cuts": Counter(
                    "gpu_planner:batch_cuts", "Batch cuts (max_transfer_batch_indices) in sends"
                ),
                "fragmented_sends": Counter(
                    "gpu_planner:fragmented_sends", "Generic sends whose page lists break"
                ),
                "runs_per_buffer": Histogram(
                    "gpu_planner:runs_per_buffer",
                    "Contiguous runs per KV buffer of each generic send",
                    buckets=RUNS_PER_BUFFER_BUCKETS,
                ),
                "paths_chosen": Counter(
                    "gpu_planner:paths_chosen",
                    "Send paths the cost model chose, and why",
                    ["path", "reason"],
                ),
                "path_observed_sends": Counter(
                    "gpu_planner:path_observed_sends",
                    "Completed sends the cost model learned from",
                    ["path"],
                ),
                "path_predicted_seconds": Counter(
                    "gpu_planner:path_predicted_seconds",
                    "The cost model's price of the completed sends it learned from",
                    ["path"],
                ),
                "path_observed_seconds": Counter(
                    "gpu_planner:path_observed_seconds",
                    "Wall time on the prefill of the completed sends the cost model learned from",
                    ["path"],
                ),
                "path_observed_over_predicted": Histogram(
                    "gpu_planner:path_observed_over_predicted",
                    "Observed over predicted time of each completed send, by path",
                    ["path"],
                    buckets=OBSERVED_OVER_PREDICTED_BUCKETS,
                ),
            }
    return _prometheus

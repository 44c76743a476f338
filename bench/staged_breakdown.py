"""Where a small staged send's time goes, stage by stage, against a live peer.

One `bench.staged_send.StagedSendBench` (a live peer engine in another
process, TCP on 127.0.0.1); the staged send is timed with `perf_counter`
around each of its stages, by wrapping the functions it calls:

- `before_gather`: from the hook's start to the first gather (planning the
  send, the choice, the route, the decode's buffers, bounds, the gather layout);
- `gather_checks`: `gather_in_parts` checking a piece before its first part;
- `gather_part`: one part gathered (pages of some buffers into the send slots);
- `submit`: one part's asynchronous write started (`AsyncWrites.submit`);
- `wait`: waiting for one part's write to end (`AsyncWrites.wait`);
- `note`: the `Staged` note (here kept in memory, as the bench does);
- `total`: the hooked send's wall time; `total_from_executor`: the same send
  with each piece written from sglang's executor (as on a device), alternated.

Beside it, the same bytes written by Mooncake alone (`wire_one`: one
descriptor per call; `wire_split`: the same bytes as 16 descriptors in one
call; `wire_pair`: two calls of half), to tell Mooncake's own cost of a
single-request batch from ours. Medians and p90 of `--repeats` sends.
Run: `python -m bench.staged_breakdown [--buffers 32] [--pages 4] [--item-len 2048]`;
prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.live_submit import live_peer
from bench.staged_send import (
    RUN_PAGES,
    SPARE_PAGES,
    StagedSendBench,
    offered,
    plugin_defaults,
)
from gpu_planner.integration.mooncake.engine import QUIET_ENV, TCP_ONLY_ENV, set_mooncake_defaults


def _timed(record: dict[str, list[float]], name: str, function: Callable) -> Callable:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            record[name].append(time.perf_counter() - started)

    return timed


def _summary(samples: list[float]) -> dict[str, float]:
    values = np.asarray(samples) * 1e3
    return {"median_ms": float(np.median(values)), "p90_ms": float(np.percentile(values, 90))}


def breakdown(bench: StagedSendBench, repeats: int) -> dict[str, Any]:
    """Each stage of `repeats` staged sends (medians, ms), beside Mooncake alone, and the same
    send through sglang's executor (`total_from_executor`), alternated with it."""
    from gpu_planner.integration.sglang import adapter, staged_send

    stages: dict[str, list[float]] = defaultdict(list)
    marks: dict[str, float] = {}
    gather_in_parts, notify = staged_send.gather_in_parts, staged_send._notify
    submit, wait = adapter.AsyncWrites.submit, adapter.AsyncWrites.wait

    def timed_parts(*args: Any) -> Any:
        if "start" in marks:
            stages["before_gather"].append(time.perf_counter() - marks.pop("start"))
        parts = _timed(stages, "gather_checks", gather_in_parts)(*args)
        while True:
            started = time.perf_counter()
            written = next(parts, None)
            if written is None:
                return
            stages["gather_part"].append(time.perf_counter() - started)
            yield written

    staged_send.gather_in_parts = timed_parts
    staged_send._notify = _timed(stages, "note", notify)
    adapter.AsyncWrites.submit = _timed(stages, "submit", submit)
    adapter.AsyncWrites.wait = _timed(stages, "wait", wait)
    try:
        for _ in range(repeats):
            marks["start"] = time.perf_counter()
            stages["total"].append(_wall(bench.send_staged))
            stages["total_from_executor"].append(_wall(lambda: _from_executor(bench)))
    finally:
        staged_send.gather_in_parts, staged_send._notify = gather_in_parts, notify
        adapter.AsyncWrites.submit, adapter.AsyncWrites.wait = submit, wait
    wire = _wire(bench, repeats)
    with offered(bench.session, None):
        hook = [_wall(bench.send_hook) for _ in range(repeats)]
    sglang = [_wall(bench.send_sglang) for _ in range(repeats)]
    return {
        "staged": {name: _summary(values) for name, values in stages.items()},
        "wire": {name: _summary(values) for name, values in wire.items()},
        "hook": _summary(hook),
        "sglang": _summary(sglang),
    }


def _from_executor(bench: StagedSendBench) -> int:
    """The staged send with each piece written from sglang's executor (as on a device)."""
    from gpu_planner.integration.sglang import staged_send

    part_writes = staged_send.part_writes
    staged_send.part_writes = lambda *_: None
    try:
        return bench.send_staged()
    finally:
        staged_send.part_writes = part_writes


def _wall(send: Callable[[], int]) -> float:
    started = time.perf_counter()
    assert send() == 0
    return time.perf_counter() - started


def _wire(bench: StagedSendBench, repeats: int) -> dict[str, list[float]]:
    """The staged bytes written by Mooncake alone: one descriptor, 16 in one call, two calls."""
    write = bench.wrapper.engine.batch_transfer_sync_write_arrays
    nbytes = bench.num_pages * bench.buffers * bench.item_len
    src, dst = bench.slots.slot(0).data_ptr(), bench.offer.capability.address
    piece = nbytes // 16

    def columns(count: int, size: int) -> tuple[np.ndarray, ...]:
        offsets = np.arange(count, dtype=np.int64) * size
        return src + offsets, dst + offsets, np.full(count, size, dtype=np.int64)

    shapes = {
        "wire_one": [columns(1, nbytes)],
        "wire_split": [columns(16, piece)],
        "wire_pair": [columns(1, nbytes // 2), columns(1, nbytes // 2)],
    }
    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        for name, calls in shapes.items():
            started = time.perf_counter()
            for call in calls:
                assert write(bench.session, *call) == 0
            samples[name].append(time.perf_counter() - started)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffers", type=int, default=32)
    parser.add_argument("--pages", type=int, default=4)
    parser.add_argument("--item-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    set_mooncake_defaults(QUIET_ENV, TCP_ONLY_ENV)
    pool_pages = args.pages + SPARE_PAGES + args.pages % RUN_PAGES
    peer_bytes = args.buffers * (pool_pages + args.pages) * args.item_len
    with plugin_defaults(), live_peer(peer_bytes) as peer:
        bench = StagedSendBench(args.pages, args.buffers, peer, args.item_len)
        result = breakdown(bench, args.repeats)
    result.update(buffers=args.buffers, pages=args.pages, item_len=args.item_len)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

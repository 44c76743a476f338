"""Time sglang's `_send_kvcache_generic` against the gpu_planner-hooked one on one input.

The input is a 128k-token request at page size 64 (2048 pages) on a 61-layer
MLA model with HiSparse destinations (the last 30 layers device-backed, with
their own page ids), fragmented page lists (runs of mean ~8 pages), and a
recording engine, so only planning and the Python around it is timed. Both
functions are checked to make the same engine calls before timing.

Usage: .venv/bin/python scripts/time_sglang_plugin.py [--repeats 20]
(needs the sglang test environment: scripts/setup.sh test). Not run by tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from sglang_plugin_support import ORIGINALS, RecordingEngine, hooked_send, make_manager  # noqa: E402

NUM_TOKENS = 128 * 1024
PAGE_SIZE = 64
NUM_LAYERS = 61
NUM_DEVICE_LAYERS = 30
ITEM_LEN = 576 * 2 * PAGE_SIZE  # MLA kv_lora_rank + rope, bf16, one page
MEAN_RUN_PAGES = 8


def fragmented_pages(rng: np.random.Generator, num_pages: int, pool_pages: int) -> np.ndarray:
    """`num_pages` distinct pages in runs of geometric length (mean MEAN_RUN_PAGES), shuffled."""
    lengths = rng.geometric(1.0 / MEAN_RUN_PAGES, size=num_pages)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), num_pages) + 1]
    lengths[-1] -= lengths.sum() - num_pages
    gaps = rng.integers(1, 4, size=len(lengths))
    starts = np.cumsum(np.concatenate([[0], (lengths + gaps)[:-1]]))
    assert starts[-1] + lengths[-1] <= pool_pages
    order = rng.permutation(len(lengths))
    runs = [np.arange(start, start + length) for start, length in zip(starts, lengths, strict=True)]
    return np.concatenate([runs[i] for i in order]).astype(np.int32)


def hisparse_call(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    num_pages = NUM_TOKENS // PAGE_SIZE
    pool = 4 * num_pages
    dst_ptrs = [(1 << 44) + layer * (1 << 32) for layer in range(NUM_LAYERS)]
    return {
        "mooncake_session_id": "127.0.0.1:12345",
        "src_data_ptrs": [(1 << 40) + layer * (1 << 32) for layer in range(NUM_LAYERS)],
        "dst_data_ptrs": dst_ptrs,
        "item_lens": [ITEM_LEN] * NUM_LAYERS,
        "prefill_data_indices": fragmented_pages(rng, num_pages, pool),
        "dst_data_indices": fragmented_pages(rng, num_pages, pool),
        "executor": None,
        "dst_device_data_indices": fragmented_pages(rng, num_pages, pool),
        "dst_device_data_ptrs": set(dst_ptrs[NUM_LAYERS - NUM_DEVICE_LAYERS :]),
    }


def time_send(send, call: dict, max_batch: int, repeats: int) -> tuple[list[float], list]:
    """Per-call wall times in ms, and the engine calls of the last run."""
    times = []
    for _ in range(repeats):
        engine = RecordingEngine()
        manager = make_manager(engine, mla=True, max_transfer_batch_indices=max_batch)
        start = time.perf_counter()
        assert send(manager, **call) == 0
        times.append((time.perf_counter() - start) * 1e3)
    return times, engine.calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    call = hisparse_call(seed=0)
    pages = call["prefill_data_indices"]
    print(
        f"{NUM_TOKENS} tokens, page {PAGE_SIZE}: {pages.size} pages, {NUM_LAYERS} layers "
        f"({NUM_DEVICE_LAYERS} device-backed), mean src run {pages.size / _runs(pages):.1f} pages"
    )
    for max_batch in (1024, 0):
        results = {}
        for name, send in (("sglang", ORIGINALS["send"]), ("gpu_planner", hooked_send())):
            send(make_manager(RecordingEngine(), mla=True), **call)  # warm-up
            results[name] = time_send(send, call, max_batch, args.repeats)
        assert results["sglang"][1] == results["gpu_planner"][1], "engine calls differ"
        calls = results["sglang"][1]
        descriptors = sum(len(lens) for *_, lens in calls)
        print(
            f"max_transfer_batch_indices={max_batch}: {len(calls)} engine call(s), "
            f"{descriptors} descriptors (identical for both)"
        )
        for name, (times, _) in results.items():
            print(
                f"  {name:12s} median {statistics.median(times):8.2f} ms  "
                f"min {min(times):8.2f} ms  over {args.repeats} calls"
            )


def _runs(pages: np.ndarray) -> int:
    return int(np.count_nonzero(np.diff(pages) != 1)) + 1


if __name__ == "__main__":
    main()

"""Bandwidth of the head-slice gather against a plain device copy of the same bytes.

A Llama-70B-like chunk (8 KV heads, head dim 128, bf16, page size 64) sent
from prefill TP2 rank 0 to decode TP4 rank 1: each token sends 2 of its 4
heads (512 of 1024 bytes). The gather of `--layers` layers (K and V) of
`--tokens` tokens on scattered source pages is timed with CUDA events
against `torch`'s copy of as many contiguous bytes; both move the payload
once each way, so the ratio of their times is the ratio of their bandwidths
(the target is 0.7). Source pages are a host array, as sglang's send has
them. On a machine without CUDA it times the compiled CPU loop against a
host copy, at a smaller default size.

Run: `python -m bench.head_gather [--tokens 32768] [--layers 16] [--repeats 20]`;
prints JSON (exit status 1 on CUDA below the target). NVTX ranges name the
gather and the copy (`nsys profile -t cuda,nvtx`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from gpu_planner.head_gather import chunk_layout, gather_head_slices, staging_nbytes
from gpu_planner.head_slices import HeadSliceLayout
from gpu_planner.profiling import nvtx_range

NVTX_DOMAIN = "gpu_planner.bench"
PAGE_SIZE = 64
HEAD_BYTES = 128 * 2  # head dim x bf16
SRC_HEADS, SENT_HEADS, SRC_HEAD_START = 4, 2, 2  # TP2 rank 0 -> TP4 rank 1, 8 KV heads
SLEEP_CYCLES = 20_000_000  # about 10 ms at 2 GHz: longer than the host's part of a call


def chunk_case(num_pages: int, layers: int, device: torch.device):
    """(layout of the chunk, its source buffers, scattered source pages, staging)."""
    src_token_len, slice_len = SRC_HEADS * HEAD_BYTES, SENT_HEADS * HEAD_BYTES
    capacity = 2 * num_pages
    buffers = [
        torch.empty(capacity * PAGE_SIZE * src_token_len, dtype=torch.uint8, device=device)
        for _ in range(2 * layers)
    ]
    layout = HeadSliceLayout.build(
        src_ptrs=[buffer.data_ptr() for buffer in buffers],
        dst_ptrs=[0] * len(buffers),  # the gather never reads destination addresses
        page_size=PAGE_SIZE,
        src_page_lens=PAGE_SIZE * src_token_len,
        dst_page_lens=PAGE_SIZE * slice_len,
        src_token_lens=src_token_len,
        dst_token_lens=slice_len,
        src_head_offsets=SRC_HEAD_START * HEAD_BYTES,
        dst_head_offsets=0,
        slice_lens=slice_len,
    )
    layout = chunk_layout(layout, range(len(buffers)))
    pages = np.random.default_rng(0).permutation(capacity)[:num_pages]  # host, as sglang's
    staging = torch.empty(staging_nbytes(layout, num_pages), dtype=torch.uint8, device=device)
    return layout, buffers, pages, staging


def timed(run: Callable[[], None], repeats: int, device: torch.device) -> list[float]:
    """Seconds of device work per call: CUDA events on CUDA, the wall clock on the host.

    On CUDA a sleep kernel queued before the start event keeps the device busy
    while the host validates and launches, so the events time the copy alone.
    """
    run()  # compile and touch everything once
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            run()
            times.append(time.perf_counter() - began)
    return times


def host_seconds(run: Callable[[], None], repeats: int, device: torch.device) -> float:
    """Median wall time of the call on the host (validation and launch), device work excluded."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--tokens", type=int, default=32768 if cuda else 4096)
    parser.add_argument("--layers", type=int, default=16 if cuda else 2)
    parser.add_argument("--repeats", type=int, default=20 if cuda else 5)
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    layout, buffers, pages, staging = chunk_case(args.tokens // PAGE_SIZE, args.layers, device)
    src_lens = [buffer.numel() for buffer in buffers]
    copy_source = torch.empty_like(staging)

    def gather() -> None:
        with nvtx_range("head_gather", domain=NVTX_DOMAIN):
            gather_head_slices(layout, pages, staging, src_lens)

    def copy() -> None:
        with nvtx_range("device_copy", domain=NVTX_DOMAIN):
            staging.copy_(copy_source)

    gather_s = statistics.median(timed(gather, args.repeats, device))
    gather_host_s = host_seconds(gather, args.repeats, device)
    copy_s = statistics.median(timed(copy, args.repeats, device))
    payload = staging.numel()
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "tokens": args.tokens,
        "entries": len(buffers),
        "payload_bytes": payload,
        "gather_ms": round(gather_s * 1e3, 3),
        "copy_ms": round(copy_s * 1e3, 3),
        "gather_host_ms": round(gather_host_s * 1e3, 3),  # validation and launch
        "gather_gb_s": round(2 * payload / gather_s / 1e9, 1),  # read + write
        "copy_gb_s": round(2 * payload / copy_s / 1e9, 1),
        "ratio": round(copy_s / gather_s, 3),
        "target": 0.7,
    }
    print(json.dumps(result))
    return 0 if not cuda or result["ratio"] >= result["target"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

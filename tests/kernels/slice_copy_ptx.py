"""Compile a head-slice kernel for an H200 (sm_90) without a GPU; report its global accesses.

Uses `aot_compile`'s stand-in driver (sm_90 target; nothing loads or runs)
and launches the real launcher (`gather` or `scatter`, the argument) on host
tensors for an aligned, an 8-byte and an odd geometry; prints one JSON line:
per case, the widest global load and store in the PTX (in bits) and the
number of each. Run with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import torch
from aot_compile import Sm90Driver
from triton.runtime import driver
from triton.runtime.jit import JITFunction

CASES = {  # name: (slice, head offset) in bytes; 8 KV heads of 128 bf16 values at TP2
    "aligned_16": (512, 512),
    "aligned_8": (520, 8),
    "odd": (5, 3),
}
TOKEN_LEN = 2048
PAGE_SIZE = 64

ptx: list[str] = []


def _recording_compile(original):
    def do_compile(self, key, *args, **kwargs):
        kernel = original(self, key, *args, **kwargs)
        ptx.append(kernel.asm["ptx"])
        return kernel

    return do_compile


def accesses(text: str, op: str) -> dict[str, int]:
    """Widest `op` (ld/st) of global memory in bits, and how many there are."""
    widths = []
    for vector, bits in re.findall(rf"{op}\.global(?:\.\w+)*?(?:\.v(\d))?\.[bu](\d+)", text):
        widths.append(int(vector or 1) * int(bits))
    return {"widest_bits": max(widths, default=0), "count": len(widths)}


def launch(kernel: str, staging: torch.Tensor, slice_len: int, head_offset: int) -> None:
    """One launch of `kernel` moving 4 pages of one entry between a KV buffer and the staging."""
    from gpu_planner.kernels.head_gather import launch_gather_head_slices
    from gpu_planner.kernels.head_scatter import launch_scatter_head_slices

    pages = torch.arange(4, dtype=torch.int64)
    kv = [staging.data_ptr() + head_offset, PAGE_SIZE * TOKEN_LEN, TOKEN_LEN]
    staged = [0, PAGE_SIZE * slice_len, slice_len]
    if kernel == "gather":
        entries = np.array([[*kv, *staged, slice_len]], dtype=np.int64)
        launch_gather_head_slices(staging, pages, entries, PAGE_SIZE)
    else:
        entries = np.array([[*staged, *kv, slice_len, 1]], dtype=np.int64)
        launch_scatter_head_slices(staging, pages, pages, entries, PAGE_SIZE)


def main(kernel: str) -> int:
    driver.set_active(Sm90Driver())
    JITFunction._do_compile = _recording_compile(JITFunction._do_compile)
    staging = torch.empty(1 << 20, dtype=torch.uint8)
    report = {}
    for name, (slice_len, head_offset) in CASES.items():
        launch(kernel, staging, slice_len, head_offset)
        report[name] = {"load": accesses(ptx[-1], "ld"), "store": accesses(ptx[-1], "st")}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""The head scatter lowers to an H200 cubin with the gather's copy widths.

Runs this file as a script in a subprocess with the interpreter off (Triton's
real CUDA pipeline against `aot_compile`'s sm_90 stand-in driver; no GPU
needed), recording the PTX with `gather_ptx`'s hook.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")


@pytest.fixture(scope="module")
def widths() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_16_byte_aligned_slices_move_as_128_bit_accesses(widths):
    assert widths["aligned_16"]["load"]["widest_bits"] == 128
    assert widths["aligned_16"]["store"] == {"widest_bits": 128, "count": 8}  # 16 KiB tile


def test_8_byte_aligned_slices_move_as_64_bit_words(widths):
    assert widths["aligned_8"]["store"]["widest_bits"] == 64


def test_odd_slices_fall_back_to_bytes(widths):
    assert widths["odd"]["store"]["widest_bits"] == 8


def main() -> int:
    """Compile one aligned, one 8-byte and one odd geometry; print their widest accesses."""
    import numpy as np
    import torch
    from aot_compile import Sm90Driver
    from gather_ptx import _recording_compile, accesses, ptx
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from gpu_planner.kernels.head_scatter import launch_scatter_head_slices

    driver.set_active(Sm90Driver())
    JITFunction._do_compile = _recording_compile(JITFunction._do_compile)
    staging = torch.empty(1 << 20, dtype=torch.uint8)
    pages = torch.arange(4, dtype=torch.int64)
    report = {}
    for name, (slice_len, head_offset) in {
        "aligned_16": (512, 512),  # 8 KV heads of 128 bf16 values, received from TP2
        "aligned_8": (520, 8),
        "odd": (5, 3),
    }.items():
        token_len = 2048
        row = [0, 64 * slice_len, slice_len, staging.data_ptr() + head_offset]
        entries = np.array([[*row, 64 * token_len, token_len, slice_len, 1]], dtype=np.int64)
        launch_scatter_head_slices(staging, pages, pages, entries, 64)
        report[name] = {"load": accesses(ptx[-1], "ld"), "store": accesses(ptx[-1], "st")}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())

"""The head gather lowers to an H200 cubin with the copy widths its comment promises.

Runs `gather_ptx.py` in a subprocess with the interpreter off (Triton's real
CUDA pipeline against the sm_90 stand-in driver; no GPU needed).
"""

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
    script = Path(__file__).with_name("gather_ptx.py")
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
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

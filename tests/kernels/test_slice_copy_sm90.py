"""The head gather and scatter lower to an H200 cubin with the copy widths their comment promises.

Runs `slice_copy_ptx.py` in a subprocess per kernel with the interpreter off
(Triton's real CUDA pipeline against the sm_90 stand-in driver; no GPU
needed).
"""

from pathlib import Path

import pytest
from aot_compile import script_report

pytest.importorskip("triton.backends.nvidia")


@pytest.fixture(scope="module", params=["gather", "scatter"])
def widths(request) -> dict:
    return script_report(Path(__file__).with_name("slice_copy_ptx.py"), request.param)


def test_16_byte_aligned_slices_move_as_128_bit_accesses(widths):
    assert widths["aligned_16"]["load"]["widest_bits"] == 128
    assert widths["aligned_16"]["store"] == {"widest_bits": 128, "count": 8}  # 16 KiB tile


def test_8_byte_aligned_slices_move_as_64_bit_words(widths):
    assert widths["aligned_8"]["store"]["widest_bits"] == 64


def test_odd_slices_fall_back_to_bytes(widths):
    assert widths["odd"]["store"]["widest_bits"] == 8

"""Every kernel variant lowers to an H200 cubin; after warm-up no plan or staged copy compiles.

Runs `aot_compile.py` in a subprocess with the interpreter off (Triton's real
CUDA pipeline against an sm_90 stand-in driver; no GPU needed).
"""

from pathlib import Path

import pytest
from aot_compile import script_report

pytest.importorskip("triton.backends.nvidia")

# Page dtype combinations x constexpr flags, per kernel: what warm-up must compile.
EXPECTED_VARIANTS = {
    "_page_indices_kernel": 2 * 3,  # device slot dtype x (no host slots, int32, int64)
    "_count_runs_kernel": 2 * 2 + 2 * 2 * 2,  # src x host dst (x device dst with a device space)
    "_scan_block_counts_kernel": 1,
    "_scatter_runs_kernel": 2 * 2 + 2 * 2 * 2,
    "_expand_descriptors_kernel": 2,  # with or without a device space
    # aot_compile.SERVERS' gathers, x 2 page dtypes: MHA staged whole pages (MLA's take the
    # same tile) 1 + TP-up slices of 1..8 heads, 4 tiles; odd staged pages of two widths, 2.
    "_gather_head_slices_kernel": 2 * (1 + 4 + 2),
    # Scatters (int64 pages): MHA writers 1, 2, 4, 8: 4; MLA 1; odd writers 1: two widths,
    # writers 2: two widths at an aligned or 8-byte offset part, 4.
    "_scatter_head_slices_kernel": 4 + 1 + 2 + 4,
}


@pytest.fixture(scope="module")
def compile_report() -> dict:
    return script_report(Path(__file__).with_name("aot_compile.py"))


def test_warmup_compiles_every_variant_for_sm90(compile_report):
    per_kernel = {
        name.rsplit(".", 1)[-1]: count for name, count in compile_report["per_kernel"].items()
    }
    assert per_kernel == EXPECTED_VARIANTS


def test_no_plan_compiles_after_warmup(compile_report):
    """Page counts 1..2**20, 1/16/61 buffers, batch cuts, dtypes and views; the gathers and
    scatters of every staging path, chunk, writer and part offset: nothing new."""
    assert compile_report["swept_launches"] > 1000
    assert compile_report["new_after_warmup"] == []


def test_the_count_sees_specialisation(compile_report):
    """Without do_not_specialize, page counts 16 and 17 compile two more variants."""
    assert compile_report["control_new_compiles"] == 2

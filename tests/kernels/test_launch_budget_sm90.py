"""Once warm, the planner's launches skip Triton's JIT dispatch and run the JIT's own kernels.

Runs `launch_budget.py` in a subprocess with the interpreter off (Triton's
real CUDA pipeline against the sm_90 stand-in driver of `aot_compile.py`).
"""

from pathlib import Path

import pytest
from aot_compile import script_report

pytest.importorskip("triton.backends.nvidia")


@pytest.fixture(scope="module")
def report() -> dict:
    return script_report(Path(__file__).with_name("launch_budget.py"))


def test_a_warm_plan_launches_its_four_kernels_cached(report):
    assert report["warm_jit_runs"] > 0
    assert report["plan_jit_runs"] == 0
    assert report["plan_cached_launches"] == 4


def test_a_warm_page_conversion_launches_cached(report):
    assert report["page_indices_jit_runs"] == 0


def test_every_cached_launch_runs_the_kernel_the_jit_picks(report):
    assert report["checked_plans"] > 100
    assert report["mismatches"] == []

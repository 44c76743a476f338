"""The send-path benchmark: both sends reach a real Mooncake engine and get its refusal.

No timing is asserted: the figures are what the benchmark reports.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_bench_smoke import TINY_POLICY

from bench.cases import quick_cases
from bench.inputs import make_input
from bench.planners import make_planners
from bench.progress import ProgressBar
from bench.report import format_table
from bench.run import run_case
from bench.send_path import SendPathBench, send_path_available
from bench.targets import evaluate_targets


@pytest.fixture(scope="module")
def send_path() -> SendPathBench:
    missing = send_path_available()
    assert missing is None, f"the test environment has sglang and Mooncake: {missing}"
    return SendPathBench()


@pytest.mark.parametrize("case", quick_cases(), ids=lambda case: case.label)
def test_both_sends_are_refused_alike(send_path, case):
    send_path.prepare(make_input(case, seed=3))
    assert send_path.send_sglang() == send_path.send_hooked() == -1
    figures = send_path.measure(TINY_POLICY)
    assert figures["handoff"] == "arrays"  # the test environment's Mooncake 0.3.14
    for variant in ("sglang", "hooked"):
        assert figures[variant]["repeats"] == 1
        assert figures[variant]["alone"]["repeats"] == 1
        for timed in (figures[variant], figures[variant]["alone"]):
            for figure in ("gil_hold", "gil_hold_running", "gil_wait"):
                assert timed[figure]["calls"] == 1  # one watched call per timed one
                assert 0 <= timed[figure]["median"] <= timed[figure]["max"]
            assert timed["gil_sample_gap"] > 0
    assert figures["speedup"] > 0


def test_run_case_reports_the_send_path(send_path):
    case = quick_cases()[0]
    planners = make_planners("sglang", with_cuda=False)
    result = run_case(case, planners, TINY_POLICY, 0, ProgressBar(1), send_path)
    assert result["descriptors_identical"]
    assert result["send_path"]["status"] == -1
    table = format_table([result])
    assert "whole send path into a real Mooncake engine" in table
    assert "GIL hold" in table


def test_send_path_targets_are_checked_at_the_target_point():
    from bench.cases import TARGET

    send = {
        "speedup": 30.0,
        "speedup_alone": 20.0,
        "hooked": {"gil_hold": {"median": 2e-3, "max": 3e-3}},
    }
    cpu = {"plan_speedup": 1.0, "hand_off_speedup": 1.0, "hand_off_over_floor": 1.0}
    result = {
        "case": dataclasses.asdict(TARGET),
        "planners": {"gpu_planner-cpu": cpu},
        "send_path": send,
    }
    checks = {check.name: check.passed for check in evaluate_targets([result])}
    assert checks["page 64: whole send path >= 25x sglang's"]
    assert not checks["page 64: hooked send's longest GIL hold <= 1.5 ms"]

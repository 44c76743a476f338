"""Smoke test of the benchmark: a tiny sweep writes its outputs, and all planners agree;
the interleaved rounds' orders.

No timing is asserted: speed is what the benchmark reports, not what tests check.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench import harness
from bench.cases import quick_cases
from bench.harness import (
    RepeatPolicy,
    Stage,
    balanced_orders,
    measure_interleaved,
    paired_ratio,
)
from bench.inputs import make_input
from bench.planners import ReferenceLoopPlanner, make_planners
from bench.progress import ProgressBar
from bench.run import main, run_case

TINY_POLICY = RepeatPolicy(budget_s=0.0, min_repeats=1, max_repeats=1)


class _DropLastDescriptor(ReferenceLoopPlanner):
    """A deliberately wrong planner: the run must notice that it disagrees."""

    name = "wrong"

    def hand_off(self):
        batches = super().hand_off()
        srcs, dsts, lens = batches[-1]
        return [*batches[:-1], (srcs[:-1], dsts[:-1], lens[:-1])]


def test_quick_sweep_writes_json_and_png(tmp_path):
    status = main(["--quick", "--out", str(tmp_path), "--budget", "0", "--min-repeats", "1"])

    assert status == 0
    document = json.loads((tmp_path / "gpu_planner_bench.json").read_text())
    assert len(document["cases"]) == len(quick_cases())
    assert document["machine"]["versions"]["numpy"] == np.__version__
    for result in document["cases"]:
        assert result["descriptors_identical"], result["label"]
        assert result["num_descriptors"] > 0
        assert "gpu_planner-cpu" in result["planners"]
        for figures in result["planners"].values():
            assert figures["plan"]["median"] > 0
            assert figures["hand_off"]["median"] > 0
    png = (tmp_path / "gpu_planner_bench.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize("case", quick_cases(), ids=lambda case: case.label)
def test_every_planner_hands_off_the_same_descriptors(case):
    planners = [*make_planners("auto", with_cuda=False), ReferenceLoopPlanner()]
    bench_input = make_input(case, seed=7)
    hand_offs = []
    for planner in planners:
        planner.prepare(bench_input)
        hand_offs.append([tuple(map(list, batch)) for batch in planner.hand_off()])

    assert sum(len(srcs) for srcs, _, _ in hand_offs[0]) > 0
    for planner, hand_off in zip(planners[1:], hand_offs[1:], strict=True):
        assert hand_off == hand_offs[0], f"{planner.name} disagrees with {planners[0].name}"


def test_run_case_flags_a_planner_that_disagrees():
    case = dataclasses.replace(quick_cases()[0], tokens=512)
    planners = [*make_planners("loop", with_cuda=False), _DropLastDescriptor()]

    result = run_case(case, planners, TINY_POLICY, seed=0, progress=ProgressBar(1))

    assert not result["descriptors_identical"]


@pytest.mark.parametrize("count", range(1, 9))
def test_balanced_orders_put_each_stage_right_after_each_other_equally_often(count):
    orders = balanced_orders(count)
    assert all(sorted(order) == list(range(count)) for order in orders)
    followers = collections.Counter(pair for order in orders for pair in itertools.pairwise(order))
    assert set(followers) == set(itertools.permutations(range(count), 2))
    assert len(set(followers.values())) <= 1


def test_interleaved_rounds_take_the_balanced_orders():
    calls = []
    stages = {name: Stage(lambda name=name: calls.append(name)) for name in "abcd"}
    measure_interleaved(stages, RepeatPolicy(budget_s=0, min_repeats=8, max_repeats=8))
    rounds = [calls[start : start + 4] for start in range(8, len(calls), 4)]  # 2 warm-ups each
    expected = [["abcd"[stage] for stage in order] for order in balanced_orders(4)] * 2
    assert calls[:8] == ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert rounds == expected


def test_interleaved_samples_keep_their_rounds_and_pair_by_them():
    """Each sample's round is kept (not in the JSON's figures); `paired_ratio` is the median
    of the per-round ratios of two stages' samples, rounds only one of them has left out."""
    clock = {"slow": 1.0}
    stages = {
        "fast": Stage(lambda: None, timer=lambda fn: 1e-3 * clock["slow"]),
        "slow": Stage(lambda: None, timer=lambda fn: 2e-3 * clock["slow"]),
        "load": Stage(lambda: None, timer=lambda fn: clock.update(slow=clock["slow"] * 1.5) or 0),
    }
    timings = measure_interleaved(stages, RepeatPolicy(budget_s=0, min_repeats=6, max_repeats=6))
    fast, slow = timings["fast"].rounds, timings["slow"].rounds
    assert [index for index, _ in fast] == list(range(6)) == [index for index, _ in slow]
    assert "rounds" not in timings["fast"].as_dict()
    # The load stage grows the clock between rounds (and, in some orders, within one).
    paired = [s / f for (_, s), (_, f) in zip(slow, fast, strict=True)]
    assert paired_ratio(slow, fast) == pytest.approx(float(np.median(paired)))
    assert paired_ratio(slow, [(-1, 1.0)]) is None  # a warm-up pairs with nothing
    assert paired_ratio([(0, 4.0), (2, 9.0)], [(2, 3.0), (5, 1.0)]) == 3.0


@given(st.integers(1, 12), st.integers(1, 40), st.data())
def test_a_stage_sampled_in_some_rounds_takes_each_order_in_turn(period, cycles, data):
    """`wanted` of the rounds, each order of the cycle equally often (within one), spread over
    the run (each half holds about half)."""
    rounds = period * cycles
    wanted = data.draw(st.integers(0, rounds))
    taken = harness._sample_rounds(wanted, rounds, period)
    assert len(taken) == rounds and sum(taken) == wanted
    per_order = collections.Counter(index % period for index, took in enumerate(taken) if took)
    assert max(per_order.values(), default=0) - min(per_order.values(), default=0) <= 1
    assert len(per_order) == min(wanted, period)
    first_half = sum(taken[: rounds // 2])
    assert abs(first_half - wanted * (rounds // 2) / rounds) <= period


def test_a_stage_taking_half_the_samples_runs_in_every_order_alike():
    """Six stages, one of them twice as slow: it is sampled in half the rounds, as often in each
    of the six orders (so right after each other stage alike), the others in every round."""
    stages = {name: Stage(lambda: None, timer=harness_timer(name)) for name in "abcdef"}
    timings = measure_interleaved(stages, RepeatPolicy(budget_s=0.6, min_repeats=1))
    assert timings["d"].repeats == 100 and timings["a"].repeats == 200
    per_order = collections.Counter(index % 6 for index, _ in timings["d"].rounds)
    assert sorted(per_order) == list(range(6)) and max(per_order.values()) <= 17
    assert min(per_order.values()) >= 16


def test_each_sample_keeps_the_stage_that_ran_right_before_it():
    """A stage sampled in every round follows itself in the rounds a slower one skips; its
    samples split by the stage before (here: twice as long after the slow one)."""
    last: list[str | None] = [None]

    def timer_of(name: str):
        def timer(fn) -> float:
            previous, last[0] = last[0], name
            return {"fast": 1e-3, "slow": 4e-3}[name] * (2 if previous == "slow" else 1)

        return timer

    stages = {name: Stage(lambda: None, timer=timer_of(name)) for name in ("fast", "slow")}
    policy = RepeatPolicy(budget_s=0.04, min_repeats=1, max_repeats=40)
    timings = measure_interleaved(stages, policy)
    fast = timings["fast"]
    assert (fast.repeats, timings["slow"].repeats) == (40, 10)
    assert all(
        seconds == (2e-3 if previous == "slow" else 1e-3)
        for previous, (_, seconds) in zip(fast.after, fast.rounds, strict=True)
    )
    after = fast.medians_after()
    assert after == {
        "fast": {"median": 1e-3, "samples": after["fast"]["samples"]},
        "slow": {"median": 2e-3, "samples": after["slow"]["samples"]},
    }
    assert after["slow"]["samples"] >= 8 and after["fast"]["samples"] >= 20
    assert after["fast"]["samples"] + after["slow"]["samples"] == 40
    assert "after" not in fast.as_dict()


def harness_timer(name: str):
    """Stage "d" takes 6 ms, every other 3 ms: a fixed timer, nothing slept."""
    seconds = 6e-3 if name == "d" else 3e-3
    return lambda fn: fn() or seconds

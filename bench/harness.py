"""Timing harness: adaptive repeats, wall-clock or CUDA-event timers, and summary statistics.

Samples run with the garbage collector off (as `timeit` does) so that a collection
triggered by one planner's garbage is not billed to another; it is collected once
before each case.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

SLOW_CALL_S = 0.5  # a warm-up slower than this counts as the first sample


@dataclasses.dataclass(frozen=True)
class RepeatPolicy:
    """How many samples to take: enough to fill `budget_s`, within [min, max]."""

    budget_s: float = 1.0
    min_repeats: int = 3
    max_repeats: int = 200


@dataclasses.dataclass(frozen=True)
class Timing:
    """Summary of repeated samples, in seconds."""

    median: float
    p10: float
    p90: float
    repeats: int
    # (round, seconds) of each sample where they were interleaved (`measure_interleaved`;
    # a warm-up taken as a sample is round -1): what `paired_ratio` pairs. Not in `as_dict`.
    rounds: tuple[tuple[int, float], ...] = dataclasses.field(default=(), repr=False)
    # Beside `rounds`: the stage whose call ran right before each sample (None: none did).
    after: tuple[str | None, ...] = dataclasses.field(default=(), repr=False)

    @classmethod
    def from_samples(
        cls,
        samples: list[float],
        rounds: Sequence[int] | None = None,
        after: Sequence[str | None] | None = None,
    ) -> Timing:
        p10, median, p90 = np.percentile(samples, [10, 50, 90])
        paired = () if rounds is None else tuple(zip(rounds, samples, strict=True))
        previous = () if after is None else tuple(after)
        return cls(float(median), float(p10), float(p90), len(samples), paired, previous)

    def as_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "p10": self.p10, "p90": self.p90, "repeats": self.repeats}

    def medians_after(self) -> dict[str, dict[str, float | int]]:
        """Interleaved: by the stage that ran right before, the median of those samples and
        their count (what one stage leaves in the caches, or cold, the next pays)."""
        by_stage: dict[str, list[float]] = {}
        for previous, (_, seconds) in zip(self.after, self.rounds, strict=True):
            if previous is not None:
                by_stage.setdefault(previous, []).append(seconds)
        return {
            name: {"median": float(np.median(values)), "samples": len(values)}
            for name, values in by_stage.items()
        }


def paired_ratio(
    numerator: Sequence[tuple[int, float]], denominator: Sequence[tuple[int, float]]
) -> float | None:
    """The median, over the rounds both were sampled in, of numerator / denominator.

    Arguments are `Timing.rounds`. Two sends sampled in one round ran one
    right after the other, so a change of the machine's load or the wire's
    speed between rounds moves both: their per-round ratio is far steadier
    than the ratio of their medians when either has few samples. None: no
    round in common.
    """
    by_round = {index: seconds for index, seconds in denominator if index >= 0}
    ratios = [seconds / by_round[index] for index, seconds in numerator if index in by_round]
    return float(np.median(ratios)) if ratios else None


Timer = Callable[[Callable[[], Any]], float]


def wall_timer(fn: Callable[[], Any]) -> float:
    """Seconds of wall time for one call of `fn`."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


GPU_HOLD_CYCLES = 20_000_000  # about 10 ms at the H200's 1.98 GHz: longer than fn's launches


def cuda_event_timer(fn: Callable[[], Any]) -> float:
    """Seconds of GPU time of `fn`'s launches, between events recorded before and after it.

    The stream first runs a sleep kernel, so `fn`'s launches queue behind it
    and run back to back: the figure is the GPU's work, not the host's
    launch gaps (which `cuda_wall_timer` counts). Raises if `fn` took longer
    on the host than the sleep, where the gaps would leak in.
    """
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(GPU_HOLD_CYCLES)
    start.record()
    fn()
    end.record()
    launched_while_held = not start.query()
    end.synchronize()
    if not launched_while_held:
        raise RuntimeError("cuda_event_timer: fn's launches outlasted the sleep; raise the hold")
    return start.elapsed_time(end) / 1e3


def cuda_wall_timer(fn: Callable[[], Any]) -> float:
    """Wall seconds of `fn` with the stream idle before and drained after it."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class Stage:
    """One timed figure: a call and the timer that times it."""

    call: Callable[[], Any]
    timer: Timer = wall_timer


def _sample_rounds(wanted: int, rounds: int, period: int) -> list[bool]:
    """Which of `rounds` rounds (whole cycles of `period` orders) take a sample: `wanted` of
    them (at most `rounds`), spread evenly, and each order in turn.

    Sample j falls in order j mod `period` of the cycle its share of the run
    reaches. Evenly spaced rounds would not do: a stage sampled every other
    round of 6 orders would run in 3 of them only, always right after the
    same 3 stages (a gather's cold caches, in one run: +90 us on a 1.8 ms send).
    """
    cycles = rounds // period
    taken = [False] * rounds
    for sample in range(wanted):
        taken[(sample * cycles // wanted) * period + sample % period] = True
    return taken


def balanced_orders(count: int) -> list[list[int]]:
    """Orders of `count` stages in which each stage runs right after each other equally often.

    A Williams design: the first order is 0, 1, n-1, 2, n-2, ...; the others
    add 1, 2, ... to every position (mod n), and for an odd n their reverses
    follow (n orders for an even n, 2n for an odd one). Starting each round
    one stage further on in a fixed order would not do: within a round every
    stage would still follow the same one.
    """
    first, low, high = [0], 1, count - 1
    while len(first) < count:
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    orders = [[(stage + shift) % count for stage in first] for shift in range(count)]
    return orders + [order[::-1] for order in orders] if count % 2 else orders


def measure_interleaved(stages: dict[str, Stage], policy: RepeatPolicy) -> dict[str, Timing]:
    """Time every stage after its warm-up calls, interleaving their samples.

    Each stage gets as many samples as `policy` allows for its own speed (the
    faster of two warm-up calls, or one slower than `SLOW_CALL_S`, which counts
    as a sample); the
    samples of all stages are spread over the same rounds, so a load change on
    the machine hits every planner alike and their ratios stay meaningful. The
    rounds take their order from `balanced_orders`, so each stage runs right
    after each other alike (what one leaves in the caches, or cold, the next
    pays), in whole cycles of them; a stage sampled in fewer rounds than the
    others takes each order in turn (`_sample_rounds`). Each sample keeps its
    round and the stage whose call ran right before it (`Timing.medians_after`):
    where stages are sampled unequally often, a stage follows itself in the
    rounds the others skip.
    """
    gc.collect()
    gc.disable()
    try:
        samples: dict[str, list[float]] = {}
        rounds_of: dict[str, list[int]] = {}
        after_of: dict[str, list[str | None]] = {}
        needed: dict[str, int] = {}
        previous: str | None = None  # the stage whose call ran last
        for name, stage in stages.items():
            warmup = stage.timer(stage.call)
            samples[name] = [warmup] if warmup >= SLOW_CALL_S else []
            rounds_of[name] = [-1] * len(samples[name])
            after_of[name] = [previous] * len(samples[name])
            previous = name
            if warmup < SLOW_CALL_S:  # a first call is often slow: it would leave too few
                warmup = min(warmup, stage.timer(stage.call))
            wanted = int(policy.budget_s / max(warmup, 1e-9))
            repeats = min(max(wanted, policy.min_repeats), policy.max_repeats)
            needed[name] = repeats - len(samples[name])
        names = list(stages)
        orders = balanced_orders(len(names))
        period = len(orders)
        rounds = -(-max(needed.values(), default=0) // period) * period  # whole cycles
        takes = {name: _sample_rounds(count, rounds, period) for name, count in needed.items()}
        for round_index in range(rounds):
            for name in (names[stage] for stage in orders[round_index % period]):
                if takes[name][round_index]:
                    samples[name].append(stages[name].timer(stages[name].call))
                    rounds_of[name].append(round_index)
                    after_of[name].append(previous)
                    previous = name
    finally:
        gc.enable()
    return {
        name: Timing.from_samples(values, rounds_of[name], after_of[name])
        for name, values in samples.items()
    }

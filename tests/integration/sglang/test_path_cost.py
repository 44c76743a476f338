"""The send-path cost model: its choice at the boundaries, its learning, its bounds, its counts.

Inputs are given (`Figures` built by hand, observations made up): no engine,
no sglang. Figures in powers of two keep the boundaries exact in floating
point.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from suite_support import set_knob

from gpu_planner import settings
from gpu_planner.integration import info
from gpu_planner.integration.sglang import counters, path_cost
from gpu_planner.integration.sglang.path_cost import (
    DIRECT,
    FOLLOW_UPS,
    HALF_LIFE,
    LEARN_EVERY_S,
    PASSES_GATE,
    PATHS,
    PRICED_FASTER,
    PRICED_SLOWER,
    PROBE_MAX_LOSS,
    STAGED,
    STALE_STEPS,
    YOUNG_MAX_LOSS,
    YOUNG_PROBE_EVERY,
    YOUNG_PROBES,
    YOUNG_SENDS,
    Figures,
    Gate,
    PathCosts,
    staged_pieces,
)

REQUEST = 2.0**-16  # about 15 us
EXACT = Figures(  # byte terms aside (sends of 0 bytes), staging costs 64 requests more than direct
    direct_fixed_s=0.0,
    staged_fixed_s=64 * REQUEST,
    request_s=REQUEST,
    link_bytes_per_s=2.0**30,
    staged_bytes_per_s=2.0**27,
    scatter_fixed_s=0.0,
    scatter_bytes_per_s=2.0**27,
)
TCP = Figures(  # the seeds' scale: loopback TCP on the 2-core CPU
    direct_fixed_s=1e-4,
    staged_fixed_s=4.5e-3,
    request_s=15e-6,
    link_bytes_per_s=1.6e9,
    staged_bytes_per_s=1 / (1 / 1.6e9 + 1 / 4e9),  # gathered, then on the link
    scatter_fixed_s=3e-4,
    scatter_bytes_per_s=4e9,
)
SLOT = 32 << 20  # the default send staging's slot (128 MiB in four)


def model(figures: Figures = EXACT, **options) -> PathCosts:
    return PathCosts(figures, **{"probe_interval": 0, **options})


# --- the choice at its boundaries, inputs given -------------------------------------------


def test_the_choice_flips_where_the_prices_cross_by_count():
    """Staged = direct + 64 requests at 0 bytes: 65 descriptors tie (direct), 66 stage."""
    costs = model()
    below, tie, above = (costs.choose("peer", count, 0, 1) for count in (64, 65, 66))
    assert tie.direct_s == tie.staged_s == 65 * REQUEST
    assert (below.path, tie.path, above.path) == (DIRECT, DIRECT, STAGED)
    assert below.reason == tie.reason == PRICED_SLOWER
    assert above.reason == PRICED_FASTER and above.staged


def test_the_choice_flips_where_the_prices_cross_by_mean_bytes():
    """No fixed costs: staging trades 1,024 requests for what each byte costs more staged.

    A byte costs 2^-27 s staged and 2^-27 s scattered against 2^-30 s direct:
    15 * 2^-30 s more. So 1,025 descriptors (one piece) of m bytes stage while
    1,025 * m * 15 * 2^-30 < 1,024 * 2^-16, that is m < 2^24 / 15,375: up to
    1,091 bytes.
    """
    costs = model(dataclasses.replace(EXACT, staged_fixed_s=0.0))
    assert costs.choose("peer", 1025, 1025 * 1091, 1).path == STAGED
    assert costs.choose("peer", 1025, 1025 * 1092, 1).path == DIRECT


def test_more_pieces_price_the_staged_send_higher():
    costs = model(dataclasses.replace(EXACT, staged_fixed_s=0.0))
    assert costs.choose("peer", 66, 0, 65).path == STAGED
    assert costs.choose("peer", 66, 0, 66).path == DIRECT  # a tie
    assert staged_pieces(0, SLOT) == staged_pieces(SLOT, SLOT) == 1
    assert staged_pieces(SLOT + 1, SLOT) == 2


SEEDS = Figures(  # the settings' defaults (bench.staged_sweep, docs/benchmarks.md)
    direct_fixed_s=1e-4,
    staged_fixed_s=1.4e-3,
    request_s=40e-6,
    link_bytes_per_s=1.6e9,
    staged_bytes_per_s=1 / (1 / 1.6e9 + 1 / 4e9),
    scatter_fixed_s=2.5e-4,
    scatter_bytes_per_s=8e9,
)


@pytest.mark.parametrize(
    ("descriptors", "mean_bytes", "path"),
    [  # bench.staged_sweep on 2026-12-03: direct (hook) against staged + scatter, medians
        (32, 4096, DIRECT),  # 1.90 ms against 2.14 ms
        (32, 65536, DIRECT),  # 4.23 ms against 6.40 ms
        (128, 16384, STAGED),  # 9.14 ms against 5.61 ms
        (2048, 65536, STAGED),  # 180 ms against 142 ms
        (1952, 2048, STAGED),  # 126 ms against 9.3 ms
        (7808, 4096, STAGED),  # 367 ms against 33 ms
    ],
)
def test_the_seeds_choose_what_was_measured_faster(descriptors, mean_bytes, path):
    """The settings' seeds, at shapes the sweep measured well apart (not at its ties)."""
    nbytes = descriptors * mean_bytes
    choice = PathCosts(Figures.seeded()).choose(
        "peer", descriptors, nbytes, staged_pieces(nbytes, SLOT)
    )
    assert choice.path == path
    seeded, expected = (dataclasses.replace(f, sends=(0, 0)) for f in (Figures.seeded(), SEEDS))
    assert dataclasses.astuple(seeded)[:-1] == pytest.approx(dataclasses.astuple(expected)[:-1])


def test_stages_from_is_the_first_count_priced_faster():
    count = TCP.stages_from(4096, SLOT)
    assert count is not None
    nbytes = count * 4096
    assert TCP.staged_s(1, nbytes) < TCP.direct_s(count, nbytes)
    assert TCP.staged_s(1, nbytes - 4096) >= TCP.direct_s(count - 1, nbytes - 4096)
    assert TCP.stages_from(65536, SLOT) is None  # the gather and scatter cost more than requests


# --- the override gate ---------------------------------------------------------------------


def test_settings_tell_a_knob_set_from_its_default(monkeypatch):
    assert not settings.explicit(settings.STAGING_MIN_DESCRIPTORS)
    set_knob(monkeypatch, settings.STAGING_MIN_DESCRIPTORS.name, "  ")  # blank: the default
    assert not settings.explicit(settings.STAGING_MIN_DESCRIPTORS)
    set_knob(monkeypatch, settings.STAGING_MIN_DESCRIPTORS.name, "64")  # the default, asked for
    assert settings.explicit(settings.STAGING_MIN_DESCRIPTORS)
    assert not settings.explicit(settings.STAGING_MAX_MEAN_BYTES)
    monkeypatch.delenv(settings.STAGING_MIN_DESCRIPTORS.name)  # loaded values hold
    assert settings.explicit(settings.STAGING_MIN_DESCRIPTORS)


def test_no_knob_set_no_gate(monkeypatch):
    assert Gate.overriding() is None
    assert path_cost.path_costs().gate is None


@pytest.mark.parametrize(
    ("knob", "value", "gate"),
    [
        (settings.STAGING_MIN_DESCRIPTORS, "100", Gate(100, 65536)),
        (settings.STAGING_MAX_MEAN_BYTES, "4096", Gate(64, 4096)),
    ],
)
def test_either_knob_set_makes_the_gate_of_both_decide(monkeypatch, knob, value, gate):
    set_knob(monkeypatch, knob.name, value)
    assert Gate.overriding() == gate
    assert path_cost.path_costs().gate == gate


def test_the_gate_decides_at_its_boundaries_whatever_the_model_prices():
    costs = model(gate=Gate(min_descriptors=100, max_mean_bytes=4096))
    fewer = costs.choose("peer", 99, 99 * 16, 1)
    enough = costs.choose("peer", 100, 100 * 4096, 1)
    larger = costs.choose("peer", 100, 100 * 4096 + 1, 1)
    assert (fewer.path, enough.path, larger.path) == (DIRECT, STAGED, DIRECT)
    assert fewer.staged_s < fewer.direct_s  # the model would have staged it
    assert (
        fewer.reason == "below the gate: fewer than GPU_PLANNER_STAGING_MIN_DESCRIPTORS descriptors"
    )
    assert (
        larger.reason == "below the gate: mean descriptor above GPU_PLANNER_STAGING_MAX_MEAN_BYTES"
    )
    assert enough.reason == PASSES_GATE
    assert costs.choose("peer", 10**6, 0, 1).path == STAGED  # no probe under the gate


# --- the probe ------------------------------------------------------------------------------


def test_a_probe_takes_the_dearer_path_once_per_interval_within_the_loss_bound():
    """Staged priced 10% over direct: past its young probes, every fifth choice of an interval
    of 4 probes it."""
    figures = dataclasses.replace(EXACT, staged_fixed_s=0.0, request_s=REQUEST)
    costs = PathCosts(figures, probe_interval=4)
    # 10 descriptors direct: 10 requests; staged: 11 pieces: 10% dearer.
    young = ([DIRECT] * YOUNG_PROBE_EVERY + [STAGED]) * YOUNG_PROBES
    paths = [costs.choose("peer", 10, 0, 11).path for _ in range(len(young) + 15)]
    assert paths == young + ([DIRECT] * 4 + [STAGED]) * 3
    probe = costs.choose("other", 10, 0, 11)
    assert probe.path == DIRECT  # each peer counts its own choices
    far = PathCosts(figures, probe_interval=4)  # 30% dearer: past the bound for one interval
    paths = [far.choose("peer", 10, 0, 13) for _ in range(40)]
    young = ([DIRECT] * YOUNG_PROBE_EVERY + [STAGED]) * YOUNG_PROBES
    stale = [DIRECT] * 8 + [STAGED]  # after two whole intervals: within 50%
    assert [choice.path for choice in paths] == young + (stale * 4)[: 40 - len(young)]
    assert [choice.reason for choice in paths if choice.path == STAGED] == [
        f"probe: staged, young, priced slower by at most {YOUNG_MAX_LOSS:.0%}"
    ] * YOUNG_PROBES + [f"probe: staged priced slower by at most {2 * PROBE_MAX_LOSS:.0%}"] * 3
    beyond = PathCosts(figures, probe_interval=4)  # 5.1x dearer: past every bound, never probed
    assert {beyond.choose("peer", 10, 0, 51).path for _ in range(400)} == {DIRECT}
    stale = 4 * STALE_STEPS  # choices after which the bound stops growing (400%: 5x)
    far_off = PathCosts(figures, probe_interval=4)  # 4.1x: young-probed, then once per 13 intervals
    paths = [far_off.choose("peer", 10, 0, 41).path for _ in range(len(young) + 2 * stale)]
    assert paths[: len(young)] == young
    assert paths[len(young) :] == ([DIRECT] * (4 * 13) + [STAGED]) * 2 + [DIRECT] * (
        2 * stale - 106
    )
    twice = PathCosts(figures, probe_interval=4)  # 2x dearer: once per 4 intervals (100%)
    paths = [twice.choose("peer", 10, 0, 20).path for _ in range(len(young) + 3 * 17)]
    assert paths[len(young) :] == ([DIRECT] * (4 * 4) + [STAGED]) * 3


def test_a_path_is_young_until_a_few_of_its_sends_are_learned():
    """Probed young while fewer than YOUNG_SENDS of its sends were learned (its first, which
    pays one-time costs, not among them) and fewer than YOUNG_PROBES young probes were made;
    then only within the ordinary loss bound."""
    figures = dataclasses.replace(EXACT, staged_fixed_s=0.0, request_s=REQUEST)

    def young_probes(costs: PathCosts) -> int:
        probes = 0
        for _ in range(120):  # staged 30% dearer (probed again only after 2 intervals); each
            # probe's send is learned at its price
            choice = costs.choose("peer", 10, 0, 13)
            if choice.path == STAGED:
                probes += 1
                costs.observe("peer", STAGED, 13, 0, choice.staged_s)
        return probes

    assert young_probes(PathCosts(figures, probe_interval=64)) == YOUNG_PROBES
    learned = PathCosts(figures, probe_interval=64)
    for _ in range(YOUNG_SENDS):  # staged sends chosen before: all but the first learned
        learned.observe("peer", STAGED, 13, 0, figures.staged_send_s(13, 0))
    assert young_probes(learned) == 1  # the probe whose send is its YOUNG_SENDS-th learned


@pytest.mark.parametrize("off", [0.7, 1.0])
def test_a_probe_that_came_in_under_its_price_is_followed_by_a_few_more(off):
    """Staged priced 90% over direct, past its young probes: probed once per 4 intervals
    (100%); a probe's send that came in 30% under its price is followed by a probe at each
    next choice, FOLLOW_UPS in a row at most; one that came in at its price is not."""
    figures = dataclasses.replace(EXACT, staged_fixed_s=0.0, request_s=REQUEST)
    costs = PathCosts(figures, probe_interval=4)
    for path, requests in ((DIRECT, 10), (STAGED, 19)) * (YOUNG_SENDS + 1):
        costs.observe("peer", path, requests, 0, figures.send_s(path, requests, 0))
    choices = []
    for _ in range(2 * (4 * 4 + 1 + FOLLOW_UPS)):
        choice = costs.choose("peer", 10, 0, 19)
        requests = 10 if choice.path == DIRECT else 19
        seconds = figures.send_s(choice.path, requests, 0) * (off if choice.staged else 1.0)
        costs.observe("peer", choice.path, requests, 0, seconds)
        choices.append(choice)
    follow_ups = FOLLOW_UPS if off < 1 else 0
    cycle = [DIRECT] * (4 * 4) + [STAGED] * (1 + follow_ups)
    assert [choice.path for choice in choices][: 2 * len(cycle)] == cycle * 2
    staged = [choice.reason for choice in choices if choice.staged][: 1 + follow_ups]
    assert (
        staged
        == [f"probe: staged priced slower by at most {4 * PROBE_MAX_LOSS:.0%}"]
        + [f"probe: staged, came in under its price, priced slower by at most {YOUNG_MAX_LOSS:.0%}"]
        * follow_ups
    )


def test_a_probe_can_take_direct_too_and_names_itself():
    costs = PathCosts(dataclasses.replace(EXACT, staged_fixed_s=0.0), probe_interval=2)
    choices = [costs.choose("peer", 11, 0, 10) for _ in range(3)]
    assert [choice.path for choice in choices] == [STAGED, STAGED, DIRECT]
    assert choices[2].reason == f"probe: direct priced slower by at most {PROBE_MAX_LOSS:.0%}"


# --- never the dearer path by its own model ------------------------------------------------

positive = st.floats(min_value=1e-7, max_value=1e-2)
bandwidth = st.floats(min_value=1e7, max_value=1e13)
figures_strategy = st.builds(
    Figures,
    direct_fixed_s=st.floats(min_value=0, max_value=1e-1),
    staged_fixed_s=st.floats(min_value=0, max_value=1e-1),
    request_s=positive,
    link_bytes_per_s=bandwidth,
    staged_bytes_per_s=bandwidth,
    scatter_fixed_s=st.floats(min_value=0, max_value=1e-2),
    scatter_bytes_per_s=bandwidth,
)
peers = st.sampled_from(["a", "b", "c"])
shape = st.tuples(
    st.integers(min_value=1, max_value=1 << 16),  # descriptors
    st.integers(min_value=0, max_value=1 << 32),  # bytes
    st.integers(min_value=1, max_value=64),  # staged pieces
)
observation = st.tuples(
    peers,
    st.sampled_from(PATHS),
    st.integers(min_value=1, max_value=1 << 16),
    st.integers(min_value=0, max_value=1 << 32),
    st.floats(min_value=1e-6, max_value=10.0),
    st.booleans(),
)
step = st.one_of(
    st.tuples(st.just("choose"), peers, shape), st.tuples(st.just("observe"), observation)
)


@given(
    seeds=figures_strategy, steps=st.lists(step, max_size=60), interval=st.sampled_from([0, 3, 8])
)
def test_it_never_chooses_a_path_its_own_model_prices_higher(seeds, steps, interval):
    """Whatever it learned: the cheaper path, direct on a tie; a probe only as bounded."""
    costs = PathCosts(seeds, probe_interval=interval)
    since_taken: dict[tuple[str, str], int] = {}
    young_probes: dict[tuple[str, str], int] = {}
    chain: dict[tuple[str, str], int] = {}  # follow-up probes in a row
    for kind, *arguments in steps:
        if kind == "observe":
            peer, path, requests, nbytes, seconds, ok = arguments[0]
            costs.observe(peer, path, requests, nbytes, seconds, ok=ok)
            continue
        peer, (descriptors, nbytes, pieces) = arguments
        choice = costs.choose(peer, descriptors, nbytes, pieces)
        assert math.isfinite(choice.direct_s) and math.isfinite(choice.staged_s)
        cheaper = STAGED if choice.staged_s < choice.direct_s else DIRECT
        for path in PATHS:  # choices of this peer since each path was last taken
            since_taken[peer, path] = since_taken.get((peer, path), 0) + 1
        if choice.path != cheaper:
            ratio = max(choice.direct_s, choice.staged_s) / min(choice.direct_s, choice.staged_s)
            assert interval and choice.reason.startswith("probe: ")
            if ", came in under its price," in choice.reason:  # a few in a row, within 2x
                chain[peer, choice.path] = chain.get((peer, choice.path), 0) + 1
                assert chain[peer, choice.path] <= FOLLOW_UPS
                assert ratio <= (1 + YOUNG_MAX_LOSS) * (1 + 1e-12)
                since_taken[peer, choice.path] = 0
                continue
            elif ", young," in choice.reason:  # a few per path and peer, within twice the price
                young_probes[peer, choice.path] = young_probes.get((peer, choice.path), 0) + 1
                assert young_probes[peer, choice.path] <= YOUNG_PROBES
                assert ratio <= (1 + YOUNG_MAX_LOSS) * (1 + 1e-12)
                assert since_taken[peer, choice.path] > min(interval, YOUNG_PROBE_EVERY)
            else:  # at most one in `interval` choices per peer and path, 25% per interval
                intervals = min((since_taken[peer, choice.path] - 1) // interval, STALE_STEPS)
                assert intervals >= 1
                assert ratio <= (1 + PROBE_MAX_LOSS * intervals) * (1 + 1e-12)
                assert choice.reason == f"probe: {choice.path} priced slower by at most " + (
                    f"{PROBE_MAX_LOSS * intervals:.0%}"
                )
        else:
            assert choice.reason == (PRICED_FASTER if cheaper == STAGED else PRICED_SLOWER)
        since_taken[peer, choice.path] = 0
        chain[peer, choice.path] = 0  # any other choice of the path ends a chain of follow-ups


class LockedOnly(PathCosts):
    """The model with every choice taken under its lock (no lock-free shortcut)."""

    def _unprobed(self, *_arguments):
        return None


class CountedShortcuts(PathCosts):
    """The model, counting the choices its lock-free shortcut answered."""

    shortcuts = 0

    def _unprobed(self, *arguments):
        answer = super()._unprobed(*arguments)
        self.shortcuts += answer is not None
        return answer


# Sends from far below the crossover to far above it (the seeds stage from a few hundred
# descriptors of 4 KiB), and the times they took, off their seeded price by up to 4x.
send_shape = st.tuples(
    st.sampled_from([1, 8, 32, 64, 128, 256, 488, 1024, 1952, 4096]),  # descriptors
    st.sampled_from([1024, 4096, 16384]),  # mean bytes
)
seeded_step = st.tuples(
    st.sampled_from(["a", "b"]), send_shape, st.sampled_from([0.25, 0.8, 1.0, 1.3, 4.0])
)


@given(
    seeds=st.sampled_from([TCP, EXACT]),
    steps=st.lists(seeded_step, min_size=1, max_size=120),
    interval=st.sampled_from([0, 3, 8]),
)
def test_the_lock_free_choice_of_an_unprobed_send_is_the_locked_ones(seeds, steps, interval):
    """Same choices, prices, figures, probe clocks and learning as a model that always takes
    the lock, whatever it learned (each send observed on the path chosen, at its price times
    `off`); the shortcut answers only the cheaper path, never a probe."""
    quick = CountedShortcuts(seeds, probe_interval=interval)
    locked = LockedOnly(seeds, probe_interval=interval)
    for peer, (descriptors, mean_bytes), off in steps:
        nbytes, pieces = descriptors * mean_bytes, 1
        shortcuts = quick.shortcuts
        choice = quick.choose(peer, descriptors, nbytes, pieces)
        assert choice == locked.choose(peer, descriptors, nbytes, pieces)
        if quick.shortcuts > shortcuts:
            cheaper = STAGED if choice.staged_s < choice.direct_s else DIRECT
            assert choice.path == cheaper
            assert choice.reason == (PRICED_FASTER if cheaper == STAGED else PRICED_SLOWER)
        states = [costs._peers[peer] for costs in (quick, locked)]
        assert states[0].since == states[1].since and states[0].figures == states[1].figures
        assert states[0].young_probes == states[1].young_probes
        requests = descriptors if choice.path == DIRECT else pieces
        seconds = off * seeds.send_s(choice.path, requests, nbytes)
        learned = [
            costs.observe(peer, choice.path, requests, nbytes, seconds) for costs in (quick, locked)
        ]
        assert learned[0] == learned[1]
        assert states[0].unlearned_s == states[1].unlearned_s
        assert states[0].sends == states[1].sends


def test_an_unprobed_send_skips_the_lock_once_its_peer_is_kept():
    costs = CountedShortcuts(TCP, probe_interval=4)
    small = (32, 32 * 4096, 1)
    first = costs.choose("peer", *small)
    assert costs.shortcuts == 0  # no state kept yet: under the lock
    assert costs.choose("peer", *small) == first and costs.shortcuts == 1
    assert first.path == DIRECT and first.reason == PRICED_SLOWER
    large = (8192, 8192 * 1024, 1)  # staged, priced far faster: no probe of direct yet
    assert costs.choose("peer", *large).path == STAGED and costs.shortcuts == 2
    gated = CountedShortcuts(TCP, gate=Gate(64, 1 << 16))
    gated.choose("peer", 32, 4096, 1)
    gated.choose("peer", 32, 4096, 1)
    assert gated.shortcuts == 0  # a gate always decides under the lock
    near = (488, 488 * 16384, 1)  # staging priced 11% slower: within a probe's loss
    paths = [costs.choose("near", *near).path for _ in range(YOUNG_PROBE_EVERY + 1)]
    assert paths == [DIRECT] * YOUNG_PROBE_EVERY + [STAGED]


def test_a_send_not_learned_from_skips_the_lock():
    """Past a path's first HALF_LIFE learned sends, a send's time is kept without the lock
    until its path's sends since the last learned one reach LEARN_EVERY_S."""
    costs = PathCosts(TCP)

    class Refused:
        def __enter__(self):
            raise AssertionError("took the lock")

        def __exit__(self, *_):
            return False

    for _ in range(HALF_LIFE + 1):  # the first send is not learned from (a connection)
        costs.observe("peer", DIRECT, 32, 32 * 4096, 1e-3)
    state = costs._peers["peer"]
    assert state.sends[0] == HALF_LIFE and state.unlearned_s[0] == 0.0
    locked, costs._lock = costs._lock, Refused()
    assert costs.observe("peer", DIRECT, 32, 32 * 4096, 0.4 * LEARN_EVERY_S) is False
    assert costs.observe("peer", DIRECT, 32, 32 * 4096, 0.4 * LEARN_EVERY_S) is False
    assert state.unlearned_s[0] == pytest.approx(0.8 * LEARN_EVERY_S)
    with pytest.raises(AssertionError, match="took the lock"):  # this one is learned from
        costs.observe("peer", DIRECT, 32, 32 * 4096, 0.4 * LEARN_EVERY_S)
    costs._lock = locked
    assert costs.observe("peer", DIRECT, 32, 32 * 4096, 0.4 * LEARN_EVERY_S) is True
    assert state.unlearned_s[0] == 0.0 and state.sends[0] == HALF_LIFE + 1


# --- learning -------------------------------------------------------------------------------


def truth_of(costs: PathCosts, truth: Figures, peer: str, sends: int, shapes) -> None:
    """`sends` sends to `peer` taking `truth`'s times exactly, over `shapes` in turn."""
    for number in range(sends):
        descriptors, mean_bytes = shapes[number % len(shapes)]
        nbytes = descriptors * mean_bytes
        choice = costs.choose(peer, descriptors, nbytes, 1)
        requests = descriptors if choice.path == DIRECT else 1
        costs.observe(
            peer, choice.path, requests, nbytes, truth.send_s(choice.path, requests, nbytes)
        )


SHAPES = [(32, 8192), (200, 4096), (488, 4096), (1952, 2048), (4096, 1024)]


def test_it_learns_a_cheaper_staged_send_and_stages_earlier():
    """The staged fixed cost falls from 4.5 ms (the seed) to 1 ms: the crossover moves down."""
    truth = dataclasses.replace(TCP, staged_fixed_s=1e-3)
    costs = model(TCP)
    assert costs.choose("peer", 200, 200 * 4096, 1).path == DIRECT
    truth_of(costs, truth, "peer", 200, SHAPES)
    learned = costs.figures("peer")
    assert learned.staged_fixed_s == pytest.approx(1e-3, rel=0.1)
    assert learned.request_s == pytest.approx(truth.request_s, rel=0.1)
    assert costs.choose("peer", 200, 200 * 4096, 1).path == STAGED  # 3.0 ms direct, 2.2 staged
    assert learned.scatter_bytes_per_s == TCP.scatter_bytes_per_s  # never observed: the figure


def test_it_learns_a_link_with_cheap_requests():
    """RDMA-like: 2 us requests, 25 GB/s: a 488-descriptor send goes direct."""
    truth = dataclasses.replace(TCP, request_s=2e-6, link_bytes_per_s=25e9)
    costs = PathCosts(TCP, probe_interval=8)  # the probes bring its staged figures along
    truth_of(costs, truth, "peer", 300, SHAPES)
    learned = costs.figures("peer")
    assert learned.request_s == pytest.approx(2e-6, rel=0.25)
    assert costs.choose("peer", 488, 488 * 4096, 1).path == DIRECT


def test_one_outlier_moves_a_figure_by_a_bounded_share():
    """A 1,000x stall, then a 1,000x too fast sample: prices move by a few percent at most."""
    costs = model(TCP)
    truth_of(costs, TCP, "peer", 100, SHAPES)
    before = costs.choose("peer", 488, 488 * 4096, 1)
    for factor in (1000.0, 1e-3):
        costs.observe("peer", DIRECT, 488, 488 * 4096, factor * TCP.direct_s(488, 488 * 4096))
        after = costs.choose("peer", 488, 488 * 4096, 1)
        assert after.direct_s == pytest.approx(before.direct_s, rel=0.1)
        assert after.staged_s == pytest.approx(before.staged_s, rel=0.1)


def test_a_stall_among_a_peers_first_sends_moves_its_prices_little():
    """The first send learned from takes 200x its price (a loaded machine): the one-page
    direct price moves by a few percent (weighed 1/q, it went up 9x; in e2e, tenfold)."""
    costs = warmed(model(TCP), "peer")
    shape = (32, 32 * 4096)
    before = costs.choose("peer", *shape, 1).direct_s
    costs.observe("peer", DIRECT, *shape, 200 * TCP.direct_s(*shape))
    assert costs.choose("peer", *shape, 1).direct_s < 1.1 * before


def test_stalls_among_a_paths_first_sends_do_not_shut_it_out():
    """A busy machine's first learned direct sends are stalls (8x their time, as 5.2 and
    4.2 ms against 0.55 in one benchmark run): direct is priced high, staging (1.2x slower,
    its scatter included) is taken, and direct's young probes come in at its time. A send
    under its price weighs fully, so they bring direct's price back and the sends back on
    direct; weighed as a stall is (1/q^2), direct stayed priced 4x over staging, past every
    probe's bound, and nearly every send went staged."""
    seeds = Figures.seeded()
    truth = dataclasses.replace(
        seeds, direct_fixed_s=95e-6, request_s=13e-6, staged_fixed_s=0.39e-3
    )  # 32 x 1 KiB: direct 0.51 ms, staged 0.66 ms with its scatter
    shape = (32, 32 * 1024)
    assert truth.staged_s(1, shape[1]) > 1.2 * truth.direct_s(*shape)
    costs = PathCosts(seeds)
    paths, direct_sends = [], 0
    for _ in range(400):
        choice = costs.choose("peer", *shape, 1)
        paths.append(choice.path)
        requests = shape[0] if choice.path == DIRECT else 1
        seconds = truth.send_s(choice.path, requests, shape[1])
        if choice.path == DIRECT:
            direct_sends += 1
            seconds *= 8 if direct_sends in (2, 3) else 1  # the first is not learned from
        costs.observe("peer", choice.path, requests, shape[1], seconds)
    assert paths[-300:].count(STAGED) <= 300 * 2 / costs.probe_interval + YOUNG_PROBES
    figures = costs.figures("peer")
    assert figures.direct_s(*shape) == pytest.approx(truth.direct_s(*shape), rel=0.25)


def test_figures_stay_in_physical_ranges_whatever_is_observed():
    costs = model(TCP)
    for _ in range(500):
        costs.observe("peer", DIRECT, 1, 0, 10.0)  # 10 s for an empty send
        costs.observe("peer", STAGED, 1, 1 << 40, 1e-6)  # a TiB in a microsecond
    figures = costs.figures("peer")
    assert 0 <= figures.direct_fixed_s <= 1.0 and 0 <= figures.staged_fixed_s <= 1.0
    assert 1e-8 <= figures.request_s <= 1e-2
    assert 1e6 <= figures.link_bytes_per_s <= 1e13
    assert 1e6 <= figures.staged_bytes_per_s <= 1e13


# --- bounded, and one peer's failures stay its own -----------------------------------------


def test_observations_folded_at_once_learn_what_one_at_a_time_would():
    """The pending observations are folded into the sums per path, in order, with the decay
    of each later one: the same sums as folding each as it comes."""
    at_once, one_by_one = model(TCP), model(TCP)
    for number in range(3 * path_cost.SOLVE_EVERY + 5):
        path = STAGED if number % 3 == 0 else DIRECT
        requests = 1 if path == STAGED else 64 + number
        nbytes = (number + 1) * 40_000
        seconds = TCP.send_s(path, requests, nbytes) * (1 + (number % 5) / 4)
        for costs in (at_once, one_by_one):
            costs.observe("peer", path, requests, nbytes, seconds)
        one_by_one._fold(one_by_one._peers["peer"])
    assert at_once._peers["peer"].pending  # not all folded yet
    at_once._fold(at_once._peers["peer"])
    for name in ("moments", "targets"):
        folded, each = (np.array(getattr(c._peers["peer"], name)) for c in (at_once, one_by_one))
        assert folded.all()  # both paths' sums took their observations
        assert np.allclose(folded, each, rtol=1e-12, atol=0), name


def test_the_sums_are_the_decayed_weighted_normal_equations_of_the_observations():
    """An independent NumPy reference of the fit's sums: each observation's full feature
    vector (its terms' prices at the seeds' scale, zero for the other path's), weighed
    1 / (price^2 q^2 NOISE^2) for a time q over its price (1 under it) and decayed by
    every later observation of its path; the per-path blocks the model keeps are exactly
    these 5 x 5 sums."""
    costs = model(TCP)
    rng = np.random.default_rng(3)
    observed = []
    for _ in range(2 * path_cost.SOLVE_EVERY + 3):
        path = PATHS[int(rng.integers(2))]
        requests, nbytes = int(rng.integers(1, 5000)), int(rng.integers(0, 1 << 30))
        seconds = TCP.send_s(path, requests, nbytes) * float(rng.uniform(0.3, 3.0))
        costs.observe("peer", path, requests, nbytes, seconds)
        observed.append((path, requests, nbytes, seconds))
    state = costs._peers["peer"]
    costs._fold(state)
    scale = np.maximum(TCP._learned(), path_cost._SCALE_FLOOR)
    # the peer's first observation and its first staged one warm it and are not learned from
    first_staged = next(number for number, row in enumerate(observed) if row[0] == STAGED)
    learned = [row for number, row in enumerate(observed) if number not in (0, first_staged)]
    for index, path in enumerate(PATHS):
        mine = [row for row in learned if row[0] == path]
        matrix, target = np.zeros((5, 5)), np.zeros(5)
        for _, requests, nbytes, seconds in mine:
            staged = float(path == STAGED)
            z = scale * [1 - staged, staged, requests, nbytes * (1 - staged), nbytes * staged]
            predicted = TCP.send_s(path, requests, nbytes)
            q = max(seconds / predicted, 1.0)  # over its price; under it weighs fully
            weight = 1 / (predicted**2 * q**2 * path_cost.NOISE**2)
            matrix = matrix * path_cost._DECAY + weight * np.outer(z, z)
            target = target * path_cost._DECAY + weight * z * seconds
        figures = list(path_cost.PATH_FIGURES[index])
        kept = np.reshape(state.moments[index], (3, 3))
        assert np.allclose(kept, matrix[np.ix_(figures, figures)], rtol=1e-9, atol=0)
        assert np.allclose(state.targets[index], target[figures], rtol=1e-9, atol=0)
        others = [i for i in range(5) if i not in figures]
        assert not matrix[others].any()  # nothing outside the block the model keeps


@given(
    st.lists(
        st.tuples(
            st.sampled_from(PATHS),
            st.integers(1, 10_000),
            st.integers(0, 1 << 32),
            st.floats(0.05, 20.0),
        ),
        min_size=2,
        max_size=3 * path_cost.SOLVE_EVERY,
    )
)
def test_the_solved_figures_are_the_ridge_fit_numpy_solves(observations):
    """The figures a peer's choice solves (`_solve`'s block elimination): NumPy's general
    solve of the sums the model kept, with the seeds as the prior (identity precision on the
    scaled figures), clamped; whatever was observed, one path only or both."""
    costs = model(TCP)
    for path, requests, nbytes, off in observations:
        costs.observe("peer", path, requests, nbytes, TCP.send_s(path, requests, nbytes) * off)
    state = costs._peers["peer"]
    costs._fold(state)
    scale = np.maximum(TCP._learned(), path_cost._SCALE_FLOOR)
    matrix = np.eye(5) / path_cost.SEED_SPREAD**2
    target = matrix @ (np.array(TCP._learned()) / scale)
    for figures, moments, targets in zip(
        path_cost.PATH_FIGURES, state.moments, state.targets, strict=True
    ):
        matrix[np.ix_(figures, figures)] += np.reshape(moments, (3, 3))
        target[list(figures)] += targets
    expected = np.clip(
        np.linalg.solve(matrix, target) * scale,
        np.minimum(path_cost._LOWER, TCP._learned()),
        np.maximum(path_cost._UPPER, TCP._learned()),
    )
    assert np.allclose(costs.figures("peer")._learned(), expected, rtol=1e-9, atol=0)


def test_its_state_is_bounded_under_10000_sends_to_100_peers():
    costs = PathCosts(TCP, probe_interval=16)
    rounds, reasons = [], set()
    for number in range(10_000):
        peer = f"decode-{number % 100}"
        descriptors, mean_bytes = SHAPES[(number // 100) % len(SHAPES)]
        nbytes = descriptors * mean_bytes
        choice = costs.choose(peer, descriptors, nbytes, 1)
        reasons.add(choice.reason)
        requests = descriptors if choice.path == DIRECT else 1
        seconds = TCP.send_s(choice.path, requests, nbytes) * (1 + (number % 7) / 10)
        costs.observe(peer, choice.path, requests, nbytes, seconds, ok=number % 11 != 0)
        if number in (99, 9_999):
            rounds.append(costs.state_bytes())
    assert rounds[0] == rounds[1]  # 100 sends or 10,000: the same state
    assert len(costs.peers()) == 100
    assert len(reasons) <= 8  # a fixed set of reasons, not one per peer or shape
    for peer in costs.peers():
        state = costs._peers[peer]
        assert max(state.since) <= costs.probe_interval
        weights = [np.trace(np.reshape(moments, (3, 3))) for moments in state.moments]
        assert all(math.isfinite(weight) for weight in weights)
    for number in range(1000):  # more peers than it keeps: the least recently used go
        costs.choose(f"other-{number}", 64, 64 * 4096, 1)
    assert len(costs.peers()) == path_cost.MAX_PEERS
    assert costs.state_bytes() == rounds[0] // 100 * path_cost.MAX_PEERS


def test_a_peer_whose_sends_start_failing_poisons_no_figures():
    """Failed sends change nothing; a slow peer's sends change only that peer's figures."""
    costs = model(TCP)
    truth_of(costs, TCP, "healthy", 60, SHAPES)
    truth_of(costs, TCP, "failing", 60, SHAPES)
    healthy, failing = costs.figures("healthy"), costs.figures("failing")
    for path in PATHS:
        for seconds in (60.0, 1e-9, 0.0, -1.0, math.inf, math.nan):
            assert not costs.observe("failing", path, 488, 488 * 4096, seconds, ok=False)
        for seconds in (0.0, -1.0, math.inf, math.nan):  # not a time, even if it "succeeded"
            assert not costs.observe("failing", path, 488, 488 * 4096, seconds)
        assert not costs.observe("failing", path, 0, 4096, 1.0)  # no request
    assert costs.figures("failing") == failing
    assert costs.figures("healthy") == healthy
    for _ in range(200):  # its successful sends turn 10x slower: its own figures follow
        for path in PATHS:
            costs.observe("failing", path, 488, 488 * 4096, 10 * TCP.send_s(path, 488, 488 * 4096))
    slow = costs.figures("failing")
    assert slow.direct_s(488, 488 * 4096) > 5 * failing.direct_s(488, 488 * 4096)
    assert costs.figures("healthy") == healthy
    with pytest.raises(ValueError, match="unknown path"):
        costs.observe("healthy", "bounced", 1, 1, 1.0)


def test_the_same_sends_give_the_same_choices_and_figures():
    """No randomness: two models fed one history choose alike, to the last bit."""
    histories = []
    for _ in range(2):
        costs = PathCosts(TCP, probe_interval=4)
        truth_of(costs, dataclasses.replace(TCP, staged_fixed_s=2e-3), "peer", 100, SHAPES)
        choices = [costs.choose("peer", count, count * 4096, 1) for count in range(1, 2000, 37)]
        histories.append((choices, costs.figures("peer")))
    assert histories[0] == histories[1]


def warmed(costs: PathCosts, *peers: str) -> PathCosts:
    """`costs` past each peer's first send of each path (which pays one-time costs, unlearned)."""
    for peer in peers:
        for path in PATHS:
            assert not costs.observe(peer, path, 1, 4096, 1.0)
    return costs


def test_a_peers_first_send_and_its_first_staged_one_are_not_learned_from():
    """The first pays Mooncake's connection to the peer; staging has first-use costs of its
    own; a first direct send after a staged one pays neither."""
    costs = model(TCP)
    assert not costs.observe("peer", STAGED, 1, 4096, 0.5)  # 100x its price: a cold start
    assert costs.figures("peer") == dataclasses.replace(TCP, sends=(0, 0))
    assert costs.observe("peer", STAGED, 1, 4096, TCP.staged_send_s(1, 4096))
    assert costs.observe("peer", DIRECT, 1, 4096, TCP.direct_s(1, 4096))
    assert costs.figures("peer").sends == (1, 1)
    direct_first = model(TCP)
    assert not direct_first.observe("peer", DIRECT, 1, 4096, 0.5)  # the connection
    assert not direct_first.observe("peer", STAGED, 1, 4096, 0.5)  # the staging's first use
    assert direct_first.figures("peer") == dataclasses.replace(TCP, sends=(0, 0))


def test_past_its_first_sends_a_path_is_learned_from_once_per_learn_every_s():
    """A path's first HALF_LIFE learned sends are all learned from; then its sends once per
    LEARN_EVERY_S of their time (a quarter of it: every fourth; longer: each), paths apart."""
    costs = model(TCP)
    quarter = path_cost.LEARN_EVERY_S / 4
    costs.observe("peer", DIRECT, 32, 0, quarter)  # the connection: not learned from
    learned = [costs.observe("peer", DIRECT, 32, 0, quarter) for _ in range(path_cost.HALF_LIFE)]
    assert all(learned)
    learned = [costs.observe("peer", DIRECT, 32, 0, quarter) for _ in range(12)]
    assert learned == [False, False, False, True] * 3
    assert all(costs.observe("peer", DIRECT, 32, 0, path_cost.LEARN_EVERY_S) for _ in range(4))
    assert costs.observe("peer", STAGED, 1, 0, quarter) is False  # the staging's first use
    assert all(costs.observe("peer", STAGED, 1, 0, quarter) for _ in range(8))  # young: each
    assert costs.figures("peer").sends == (path_cost.HALF_LIFE + 3 + 4, 8)


def test_a_probes_send_is_learned_from_whatever_its_time():
    """Past the first sends, a probe's send is still learned from (what it is for), and only
    the probe's: the sends after it are learned once per LEARN_EVERY_S again."""
    figures = dataclasses.replace(EXACT, staged_fixed_s=0.0, request_s=REQUEST)
    costs = PathCosts(figures, probe_interval=4)
    short = path_cost.LEARN_EVERY_S / 8
    costs.observe("peer", DIRECT, 10, 0, short)
    costs.observe("peer", STAGED, 11, 0, short)  # both warm: their first sends
    for _ in range(path_cost.HALF_LIFE):
        for path, requests in ((DIRECT, 10), (STAGED, 11)):
            assert costs.observe("peer", path, requests, 0, short)
    learned = []
    for _ in range(40):  # staged 10% dearer: probed once per interval
        choice = costs.choose("peer", 10, 0, 11)
        requests = 10 if choice.path == DIRECT else 11
        learned.append((choice.path, costs.observe("peer", choice.path, requests, 0, short)))
    staged = [ok for path, ok in learned if path == STAGED]
    assert len(staged) == 8 and all(staged)
    direct = [ok for path, ok in learned if path == DIRECT]
    assert sum(direct) == len(direct) // 8  # one in eight


def test_threads_share_one_model():
    costs = warmed(PathCosts(TCP, probe_interval=8), "decode-0", "decode-1", "decode-2")

    def sender(number: int) -> None:
        for send in range(300):
            peer = f"decode-{(number + send) % 3}"
            choice = costs.choose(peer, 488, 488 * 4096, 1)
            requests = 488 if choice.path == DIRECT else 1
            seconds = path_cost.LEARN_EVERY_S * (1 + send % 5)  # each learned from
            costs.observe(peer, choice.path, requests, 488 * 4096, seconds)

    threads = [threading.Thread(target=sender, args=(number,)) for number in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(sum(costs.figures(peer).sends) for peer in costs.peers()) == 6 * 300


# --- counters, the process's instance, info -------------------------------------------------


def test_observations_are_counted_and_choices_are_left_to_the_caller():
    """`choose` counts nothing (the staged send counts the path a send took: a staged choice
    whose request does not line up goes direct); every learned observation is counted."""
    costs = warmed(model(TCP), "peer")
    before = counters.snapshot()
    assert costs.choose("peer", 32, 32 * 8192, 1).reason == PRICED_SLOWER
    assert costs.choose("peer", 1952, 1952 * 2048, 1).reason == PRICED_FASTER
    predicted = TCP.direct_s(32, 32 * 8192)
    costs.observe("peer", DIRECT, 32, 32 * 8192, 2 * predicted)
    costs.observe("peer", DIRECT, 32, 32 * 8192, 1.0, ok=False)  # not counted
    after = counters.snapshot()
    assert after["paths_chosen"] == before["paths_chosen"]
    times, earlier = after["path_times"][DIRECT], before["path_times"].get(DIRECT, {})
    assert times["sends"] - earlier.get("sends", 0) == 1
    assert times["predicted_seconds"] - earlier.get("predicted_seconds", 0) == pytest.approx(
        predicted
    )
    assert times["observed_seconds"] - earlier.get("observed_seconds", 0) == pytest.approx(
        2 * predicted
    )


def test_the_counts_reach_sglang_metrics(tmp_path):
    sender = (
        "from gpu_planner.integration.sglang.path_cost import path_costs\n"
        "costs = path_costs()\n"
        "from gpu_planner.integration.sglang.counters import record_path_choice\n"
        "choice = costs.choose('decode', 32, 32 * 8192, 1)\n"
        "record_path_choice(choice.path, choice.reason)  # as the staged send counts it\n"
        "costs.observe('decode', choice.path, 32, 32 * 8192, 1.0)  # its first: unlearned\n"
        "costs.observe('decode', choice.path, 32, 32 * 8192, 1e-3)\n"
    )
    environment = {key: value for key, value in os.environ.items() if key[:12] != "GPU_PLANNER_"}
    environment["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    subprocess.run([sys.executable, "-c", sender], env=environment, check=True, timeout=120)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    text = generate_latest(registry).decode()
    assert (
        'gpu_planner:paths_chosen_total{path="direct",reason="staging priced slower"} 1.0' in text
    )
    assert 'gpu_planner:path_observed_sends_total{path="direct"} 1.0' in text
    assert 'gpu_planner:path_observed_seconds_total{path="direct"} 0.001' in text
    assert 'gpu_planner:path_predicted_seconds_total{path="direct"}' in text
    assert 'gpu_planner:path_observed_over_predicted_bucket{le="2.0",path="direct"} 1.0' in text


def test_the_process_instance_is_rebuilt_when_settings_reload(monkeypatch):
    costs = path_cost.path_costs()
    assert path_cost.path_costs() is costs
    assert costs.seeds == Figures.seeded() and costs.probe_interval == 64
    set_knob(monkeypatch, settings.COST_STAGED_FIXED_US.name, "1000")
    set_knob(monkeypatch, settings.COST_PROBE_INTERVAL.name, "0")
    rebuilt = path_cost.path_costs()
    assert rebuilt is not costs
    assert rebuilt.seeds.staged_fixed_s == pytest.approx(1e-3) and rebuilt.probe_interval == 0


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("GPU_PLANNER_COST_REQUEST_US", "0"),
        ("GPU_PLANNER_COST_LINK_GB_S", "-1"),
        ("GPU_PLANNER_COST_GATHER_GB_S", "inf"),
        ("GPU_PLANNER_COST_SCATTER_GB_S", "nan"),
        ("GPU_PLANNER_COST_STAGED_FIXED_US", "-0.5"),
        ("GPU_PLANNER_COST_DIRECT_FIXED_US", "4ms"),
        ("GPU_PLANNER_COST_PROBE_INTERVAL", "-1"),
    ],
)
def test_a_bad_seed_names_its_knob(monkeypatch, name, value):
    set_knob(monkeypatch, name, value)
    with pytest.raises(settings.SettingError, match=f"{name}={value!r}"):
        settings.load()


def test_info_prints_the_models_figures(monkeypatch):
    rows = dict(info.send_path())
    assert rows["chooses by"].startswith("the cost model")
    assert rows["seeded direct"] == "0.10 ms + 40.0 us per descriptor + bytes at 1.60 GB/s"
    assert rows["seeded staged"].startswith("1.40 ms + 40.0 us per piece")
    assert rows["probe"].startswith("at most 1 send in 64 per peer")
    assert rows["peers"].startswith("none in this process")
    costs = path_cost.path_costs()
    costs.choose("decode-7", 64, 64 * 4096, 1)
    warmed(costs, "decode-7").observe("decode-7", DIRECT, 64, 64 * 4096, 2e-3)
    rows = dict(info.send_path())
    assert "(learned from 1 direct and 0 staged sends)" in rows["peer decode-7"]
    set_knob(monkeypatch, settings.STAGING_MIN_DESCRIPTORS.name, "100")
    set_knob(monkeypatch, settings.GATHER_STAGING_BYTES.name, str(128 << 20))
    rows = dict(info.send_path())
    assert rows["chooses by"].startswith("the gate: sends of >= 100 descriptors")
    count = Figures.seeded().stages_from(4096, SLOT)
    assert f"{count} of 4 KiB" in rows["seeds stage from"]
    assert f"{Figures.seeded().stages_from(65536, SLOT)} of 64 KiB" in rows["seeds stage from"]

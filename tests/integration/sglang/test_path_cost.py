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
from gpu_planner.integration.sglang import counters, path_cost, path_fit
from gpu_planner.integration.sglang.path_cost import (
    DIRECT,
    FOLLOW_UPS,
    PASSES_GATE,
    PATHS,
    PRICED_FASTER,
    PRICED_SLOWER,
    PROBE,
    PROBE_FOLLOW_UP,
    PROBE_MAX_LOSS,
    PROBE_YOUNG,
    REASONS,
    STAGED,
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


def chose(costs: PathCosts, peer: str, descriptors: int, nbytes: int, pieces: int):
    """`costs`' choice for a send, taken on the path chosen (as the staged send does)."""
    choice = costs.choose(peer, descriptors, nbytes, pieces)
    costs.taken(peer, choice, choice.path)
    return choice


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
    of 4 probes it; a path priced r times the other, once per ceil((r - 1) / 25%) intervals,
    however far (no path is shut out for good)."""
    figures = dataclasses.replace(EXACT, staged_fixed_s=0.0, request_s=REQUEST)
    costs = PathCosts(figures, probe_interval=4)
    # 10 descriptors direct: 10 requests; staged: 11 pieces: 10% dearer.
    young = ([DIRECT] * YOUNG_PROBE_EVERY + [STAGED]) * YOUNG_PROBES
    paths = [chose(costs, "peer", 10, 0, 11).path for _ in range(len(young) + 15)]
    assert paths == young + ([DIRECT] * 4 + [STAGED]) * 3
    probe = chose(costs, "other", 10, 0, 11)
    assert probe.path == DIRECT  # each peer counts its own choices
    far = PathCosts(figures, probe_interval=4)  # 30% dearer: past the bound for one interval
    paths = [chose(far, "peer", 10, 0, 13) for _ in range(40)]
    stale = [DIRECT] * 8 + [STAGED]  # after two whole intervals: within 50%
    assert [choice.path for choice in paths] == young + (stale * 4)[: 40 - len(young)]
    assert [choice.reason for choice in paths if choice.path == STAGED] == [
        PROBE_YOUNG
    ] * YOUNG_PROBES + [PROBE] * 3
    assert [choice.young for choice in paths if choice.probe] == [True] * YOUNG_PROBES + [False] * 3
    for pieces, intervals in ((51, 17), (41, 13), (20, 4)):  # 5.1x: never young-probed
        costs = PathCosts(figures, probe_interval=4)
        skip = 0 if pieces > 10 * (1 + YOUNG_MAX_LOSS) else len(young)
        paths = [
            chose(costs, "peer", 10, 0, pieces).path for _ in range(skip + 3 * (4 * intervals + 1))
        ]
        assert paths[:skip] == young[:skip]
        assert paths[skip:] == ([DIRECT] * (4 * intervals) + [STAGED]) * 3


def test_the_choice_is_pure_and_only_the_path_taken_moves_the_clocks():
    """`choose` proposes; `taken` with the path the send went moves the clocks, and a probe
    counts only where its own path was taken (a staged probe that could not stage is not one)."""
    figures = dataclasses.replace(EXACT, staged_fixed_s=0.0, request_s=REQUEST)
    costs = PathCosts(figures, probe_interval=64)
    for _ in range(YOUNG_PROBE_EVERY):
        chose(costs, "peer", 10, 0, 11)
    probe = costs.choose("peer", 10, 0, 11)
    assert probe.path == STAGED and probe.reason == PROBE_YOUNG and probe.probe and probe.young
    assert [costs.choose("peer", 10, 0, 11) for _ in range(3)] == [probe] * 3  # pure
    for _ in range(YOUNG_PROBES + 2):  # went direct each time (no free slot): no probe taken
        costs.taken("peer", probe, DIRECT)
        costs.taken("peer", probe, DIRECT)
        assert costs.choose("peer", 10, 0, 11) == probe  # still young, still proposed
    costs.taken("peer", probe, STAGED)  # taken: one young probe
    assert not costs.observe("peer", STAGED, 11, 0, 1e-9)  # the staging's first use
    paths = [chose(costs, "peer", 10, 0, 11).path for _ in range(3 * (YOUNG_PROBE_EVERY + 1))]
    assert paths == ([DIRECT] * YOUNG_PROBE_EVERY + [STAGED]) * 3  # the three young ones left
    assert chose(costs, "peer", 10, 0, 11).path == DIRECT


def test_a_path_is_young_until_a_few_of_its_sends_are_learned():
    """Probed young while fewer than YOUNG_SENDS of its sends were learned (its first, which
    pays one-time costs, not among them) and fewer than YOUNG_PROBES young probes were made;
    then only within the ordinary loss bound."""
    figures = dataclasses.replace(EXACT, staged_fixed_s=0.0, request_s=REQUEST)

    def young_probes(costs: PathCosts) -> int:
        probes = 0
        for _ in range(120):  # staged 30% dearer (probed again only after 2 intervals); each
            # probe's send is learned at its price
            choice = chose(costs, "peer", 10, 0, 13)
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
        choice = chose(costs, "peer", 10, 0, 19)
        requests = 10 if choice.path == DIRECT else 19
        seconds = figures.send_s(choice.path, requests, 0) * (off if choice.staged else 1.0)
        costs.observe("peer", choice.path, requests, 0, seconds)
        choices.append(choice)
    follow_ups = FOLLOW_UPS if off < 1 else 0
    cycle = [DIRECT] * (4 * 4) + [STAGED] * (1 + follow_ups)
    cycles = 2 if off == 1 else 1  # (under its price, staging's price falls: probed sooner)
    assert [choice.path for choice in choices][: cycles * len(cycle)] == cycle * cycles
    staged = [choice.reason for choice in choices if choice.staged][: 1 + follow_ups]
    assert staged == [PROBE] + [PROBE_FOLLOW_UP] * follow_ups


def test_a_probe_can_take_direct_too_and_names_itself():
    costs = PathCosts(dataclasses.replace(EXACT, staged_fixed_s=0.0), probe_interval=2)
    choices = [chose(costs, "peer", 11, 0, 10) for _ in range(3)]
    assert [choice.path for choice in choices] == [STAGED, STAGED, DIRECT]
    assert choices[2].reason == PROBE and choices[2].probe


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
        choice = chose(costs, peer, descriptors, nbytes, pieces)
        assert math.isfinite(choice.direct_s) and math.isfinite(choice.staged_s)
        assert choice.reason in REASONS
        cheaper = STAGED if choice.staged_s < choice.direct_s else DIRECT
        for path in PATHS:  # choices of this peer since each path was last taken
            since_taken[peer, path] = since_taken.get((peer, path), 0) + 1
        if choice.path != cheaper:
            ratio = max(choice.direct_s, choice.staged_s) / min(choice.direct_s, choice.staged_s)
            assert interval and choice.probe
            if choice.reason == PROBE_FOLLOW_UP:  # a few in a row, within 5x
                chain[peer, choice.path] = chain.get((peer, choice.path), 0) + 1
                assert chain[peer, choice.path] <= FOLLOW_UPS
                assert ratio <= (1 + YOUNG_MAX_LOSS) * (1 + 1e-12)
                since_taken[peer, choice.path] = 0
                continue
            elif choice.reason == PROBE_YOUNG:  # a few per path and peer, within 5x
                young_probes[peer, choice.path] = young_probes.get((peer, choice.path), 0) + 1
                assert young_probes[peer, choice.path] <= YOUNG_PROBES
                assert ratio <= (1 + YOUNG_MAX_LOSS) * (1 + 1e-12)
                assert since_taken[peer, choice.path] > min(interval, YOUNG_PROBE_EVERY)
            else:  # at most one in `interval` choices per peer and path, 25% per interval
                intervals = (since_taken[peer, choice.path] - 1) // interval
                assert intervals >= 1
                assert ratio <= (1 + PROBE_MAX_LOSS * intervals) * (1 + 1e-12)
                assert choice.reason == PROBE
        else:
            assert choice.reason == (PRICED_FASTER if cheaper == STAGED else PRICED_SLOWER)
        since_taken[peer, choice.path] = 0
        chain[peer, choice.path] = 0  # any other choice of the path ends a chain of follow-ups


# --- learning -------------------------------------------------------------------------------


def truth_of(costs: PathCosts, truth: Figures, peer: str, sends: int, shapes) -> None:
    """`sends` sends to `peer` taking `truth`'s times exactly, over `shapes` in turn."""
    for number in range(sends):
        descriptors, mean_bytes = shapes[number % len(shapes)]
        nbytes = descriptors * mean_bytes
        choice = chose(costs, peer, descriptors, nbytes, 1)
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
        choice = chose(costs, "peer", *shape, 1)
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
    assert 0 <= figures.direct_fixed_s <= 60.0 and 0 <= figures.staged_fixed_s <= 60.0
    assert 1e-8 <= figures.request_s <= 1e-2 and 1e-8 <= figures.piece_s <= 1e-2
    assert 1e6 <= figures.link_bytes_per_s <= 1e13
    assert 1e6 <= figures.staged_bytes_per_s <= 1e13


# --- bounded, and one peer's failures stay its own -----------------------------------------


class ReferenceFit:
    """An independent NumPy statement of `path_fit`'s fit, for one peer: per path, the decayed
    weighted normal equations around its anchor, the ring of ratios and the re-anchoring."""

    def __init__(self, seeds: Figures) -> None:
        self.seeds = seeds
        self.anchors = [np.array(path_figures(seeds, path)) for path in PATHS]
        self.lower = [np.minimum(path_fit.LOWER, anchor) for anchor in self.anchors]
        self.upper = [np.maximum(path_fit.UPPER, anchor) for anchor in self.anchors]
        self.warm = {path: False for path in PATHS}
        self.sends = [0, 0]
        self.figures = [anchor.copy() for anchor in self.anchors]
        for index in range(2):
            self.restart(index, self.anchors[index])

    def restart(self, index: int, anchor: np.ndarray) -> None:
        self.anchors[index] = anchor
        self.scale = getattr(self, "scale", [None, None])
        self.scale[index] = np.maximum(anchor, path_fit.SCALE_FLOOR)
        self.sums = getattr(self, "sums", [None, None])
        self.sums[index] = (np.zeros((3, 3)), np.zeros(3))
        self.ring = getattr(self, "ring", [None, None])
        self.ring[index] = [1.0] * path_fit.SHIFT_WINDOW

    def solve(self, index: int) -> np.ndarray:
        matrix, target = self.sums[index]
        prior = 1 / path_fit.SEED_SPREAD**2
        x = np.linalg.solve(
            matrix + prior * np.eye(3), target + prior * self.anchors[index] / self.scale[index]
        )
        return np.clip(x * self.scale[index], self.lower[index], self.upper[index])

    def observe(self, path: str, requests: int, nbytes: int, seconds: float) -> None:
        if not self.warm[path]:
            connected = any(self.warm.values())
            self.warm[path] = True
            if path == STAGED or not connected:
                return
        index = PATHS.index(path)
        fixed, per_request, per_byte = self.figures[index]
        price = max(fixed + per_request * requests + per_byte * nbytes, 1e-12)
        ratio = seconds / price
        ring = self.ring[index]
        ring.append(ratio)
        del ring[0]
        typical = float(np.median(ring))
        if typical > path_fit.SHIFT_FACTOR or typical < 1 / path_fit.SHIFT_FACTOR:
            level, typical_before = self.solve(index), typical
            self.restart(index, np.clip(level * typical, self.lower[index], self.upper[index]))
            ratio, typical = ratio / typical, 1.0
            self.ring[index] = [1.0] * (path_fit.SHIFT_WINDOW - 1) + [ratio]
            price *= typical_before
        off = ratio / typical
        factor = 1.0 if off <= path_fit.OUTLIER else (path_fit.OUTLIER / off) ** 4
        z = self.scale[index] * np.array([1.0, requests, nbytes])
        weight = factor / (path_fit.NOISE**2 * price**2)
        matrix, target = self.sums[index]
        self.sums[index] = (
            matrix * path_fit.DECAY + weight * np.outer(z, z),
            target * path_fit.DECAY + weight * z * seconds,
        )
        self.figures[index] = self.solve(index)
        self.sends[index] += 1


def path_figures(figures: Figures, path: str) -> tuple[float, float, float]:
    if path == DIRECT:
        return figures.direct_fixed_s, figures.request_s, 1 / figures.link_bytes_per_s
    return figures.staged_fixed_s, figures.piece_s, 1 / figures.staged_bytes_per_s


@given(
    st.lists(
        st.tuples(
            st.sampled_from(PATHS),
            st.integers(1, 10_000),
            st.integers(0, 1 << 32),
            st.sampled_from([0.05, 0.3, 0.8, 1.0, 1.3, 3.0, 20.0]),
        ),
        min_size=2,
        max_size=3 * path_cost.SOLVE_EVERY,
    )
)
def test_the_figures_are_the_reference_ridge_fit_of_the_observations(observations):
    """Through `observe` and `figures` only: whatever was observed (one path or both, stalls,
    lasting shifts that re-anchor a path), each path's figures are the reference's NumPy
    solve of its sums, clamped."""
    costs, reference = model(TCP), ReferenceFit(TCP)
    for path, requests, nbytes, off in observations:
        seconds = TCP.send_s(path, requests, nbytes) * off
        costs.observe("peer", path, requests, nbytes, seconds)
        reference.observe(path, requests, nbytes, seconds)
        figures = costs.figures("peer")  # solved after each observation, as the reference
        for index, path_ in enumerate(PATHS):
            scale = np.maximum(path_figures(TCP, path_), path_fit.SCALE_FLOOR)
            assert np.allclose(  # (a figure at its clamp's 0 may round to 1e-20)
                path_figures(figures, path_), reference.figures[index], rtol=1e-9, atol=0
            ) or np.all(
                np.abs(np.subtract(path_figures(figures, path_), reference.figures[index]))
                <= 1e-9 * scale
            )
        assert figures.sends == tuple(reference.sends)


def test_its_state_is_bounded_under_10000_sends_to_100_peers():
    costs = PathCosts(TCP, probe_interval=16, max_peers=256)
    rounds, reasons = [], set()
    for number in range(10_000):
        peer = f"decode-{number % 100}"
        descriptors, mean_bytes = SHAPES[(number // 100) % len(SHAPES)]
        nbytes = descriptors * mean_bytes
        choice = chose(costs, peer, descriptors, nbytes, 1)
        reasons.add(choice.reason)
        requests = descriptors if choice.path == DIRECT else 1
        seconds = TCP.send_s(choice.path, requests, nbytes) * (1 + (number % 7) / 10)
        costs.observe(peer, choice.path, requests, nbytes, seconds, ok=number % 11 != 0)
        if number in (99, 9_999):
            rounds.append(costs.state_bytes())
    assert rounds[0] == rounds[1]  # 100 sends or 10,000: the same state
    assert len(costs.peers()) == 100
    assert reasons <= set(REASONS)  # a fixed set of reasons, not one per peer or shape
    for peer in costs.peers():
        figures = costs.figures(peer)
        assert all(math.isfinite(figure) for figure in dataclasses.astuple(figures)[:-1])
    for number in range(1000):  # more peers than it keeps: the least recently used go
        costs.choose(f"other-{number}", 64, 64 * 4096, 1)
    assert len(costs.peers()) == 256
    assert costs.state_bytes() == rounds[0] // 100 * 256


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
        choice = chose(costs, "peer", 10, 0, 11)
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
            choice = chose(costs, peer, 488, 488 * 4096, 1)
            requests = 488 if choice.path == DIRECT else 1
            seconds = path_cost.LEARN_EVERY_S * (1 + send % 5)  # each learned from
            costs.observe(peer, choice.path, requests, 488 * 4096, seconds)

    threads = [threading.Thread(target=sender, args=(number,)) for number in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a sending thread did not end (a lock held for good?)"
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

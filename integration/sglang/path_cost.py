"""Which path a send to a peer takes, direct or staged, by what each would cost there now.

A send toward a decode that offers receive staging can go two ways: **direct**
(its planned descriptors, one Mooncake request each) or **staged** (gathered
into the prefill's send staging, written as a few slot-sized pieces, scattered
by the decode). `PathCosts` prices both for the send's shape and picks the
cheaper one; `path_costs()` is the process's one instance.

**The model**, per peer (the decode's Mooncake session), in seconds:

    direct = direct_fixed + request * descriptors + bytes / link
    staged = staged_fixed + request * pieces + bytes / staged_bytes
             + scatter_fixed + bytes / scatter

`request` is the link's per Mooncake request to that peer, shared by both
paths; `link` what a byte costs in the direct path's descriptors, and
`staged_bytes` what it costs staged (the gather on this device and the
slot-sized writes, together): each path's bytes are learned from its own
sends, since a byte in a 64 KiB descriptor and one in a 32 MiB piece do not
cost the same (`bench.staged_sweep`: loopback TCP moved 64 KiB descriptors at
about 1 GB/s against 1.5 GB/s for the pieces; one shared figure priced the
staged sends of 64 KiB descriptors 60% high, and they went direct, 20-40%
slower). Every figure but the decode's scatter is learned per peer from this
process's own completed sends (`observe`): the prefill never sees the
scatter, so `scatter_fixed` and `scatter` stay their settings
(docs/settings.md). Seeds (`bench.staged_sweep` on the 2-core CPU machine over
loopback TCP, docs/benchmarks.md): direct fixed 0.1 ms, 40 us per request
(40-60 us at 32-8,192 descriptors), link 1.6 GB/s (1.6-1.8 GB/s bulk); staged
fixed 1.4 ms (a 32-descriptor staged send, 1.5 ms), gather 4 GB/s (the staged
bytes' seed is link and gather in series: 1.14 GB/s, 1.09 measured at
512 MiB); scatter 4 GB/s + 0.5 ms (4.1 GB/s at 512 MiB; 0.6 ms at 32 KiB).

**Learning.** For each peer, a ridge fit of the five learned figures, with the
seeds as its prior: per path, exponentially weighted sums of the send's
features (each term's share of the seeded price) and times, halving every
`HALF_LIFE` observations of that path. The fit is on relative error, and an
observation slower than its price by a factor q weighs 1/q^2 of an ordinary
one, so one send's pull on a figure falls as 1/q the further over it is (a
stall, a sample of a bimodal wire: a 270 ms one-page send on a loaded 2-core
machine, weighed 1/q, once moved a peer's one-page direct price from 1.4 to
13.8 ms), while a lasting change of a few times is learned within tens of
sends (each pulls less at first, more as the figures come near it). One faster
than its price weighs fully: noise only adds time, so a fast send says the
price is high, and its pull is bounded anyway (its relative error is under 1).
Weighed 1/q^2 too, a path whose first learned sends were stalls stayed priced
at them: on a busy machine a peer's direct sends of 32 descriptors, 5.2 and
4.2 ms among their first, kept direct priced at 3.2 ms while its probes took
about 1 ms (each weighed 1/12), 4x the staged price, past any probe's bound,
and 426 of 432 sends went staged at 1.2x the direct send's time.
The solved figures are clamped to physical ranges. A choice solves the fit
again after every observation for a peer's first `HALF_LIFE` sends, then once
per `SOLVE_EVERY` observations (the figures move by a few percent per 8
sends). What learning costs is kept to about 1% of the sends it learns from:
past a path's first `HALF_LIFE` learned sends at a peer, its sends are learned
from once per `LEARN_EVERY_S` (2 ms) of their time, a longer send each time, a
0.6 ms one (32 descriptors) every fourth, and a probe's send always (learning
one, with its share of the sums and the solve, costs about 25 us on the 2-core
CPU after a transfer left the caches cold; the half-life counts learned sends).
The fit is plain Python float arithmetic (NumPy's calls on arrays this small
cost about 200 us there), its solve one of two 2 x 2 blocks and their shared
request figure (`_solve`). A peer's first send is not learned from (it pays Mooncake's
connection to the peer), nor the first staged one (the staging's own first-use
costs: one such send once moved the staged price of a test's peer from 4.9 to
15.6 ms); a first direct send after a staged one is (the connection was paid).
Only successful sends update (`observe(..., ok=False)` changes nothing), one
peer's sends touch only that peer's figures, and at most `MAX_PEERS` peers are kept (least recently
used dropped; a peer seen again starts from the seeds). Memory: a few hundred
floats per peer, whatever the number of sends.

**Deterministic.** The choice is a function of the peer's state and the send:
no randomness. Equal prices go direct. To keep the figures of the path it does
not choose current, a peer's send takes the path priced slower when that path
was not taken in its last `GPU_PLANNER_COST_PROBE_INTERVAL` (64) choices and is
priced at most `PROBE_MAX_LOSS` (25%) slower: at most one send in 64 per peer,
each at most 25% slower by the model (up to 400% for a path left untaken
longer, more rarely: below), and only near the crossover, where the figures
matter. Far from it (a 32-descriptor send, 5x cheaper direct) no probe
happens: the linear model carries what larger sends taught it there. A path
that is still **young** at a peer (fewer than `YOUNG_SENDS` of its sends
learned) is priced from seeds measured on another machine or day, which can be
several times off: the same loopback link moved a 32-descriptor send in 2.6 ms
one day and in 0.6 ms two days later, and seeds that price its requests at 40 us
kept sends of 128 x 16 KiB staged at 3.3 ms where direct took 2.8, never probed
(1.8x apart by the seeds; on a faster day, with the decode's scatter measured
again, 2.56x apart: staged at 2.56 ms where direct took 2.17). So a young path
is also probed when priced at most `YOUNG_MAX_LOSS` (400%: 5x) slower and not
taken in the last `YOUNG_PROBE_EVERY` (2)
choices, at most `YOUNG_PROBES` (4) times per path and peer: a bounded cost,
paid once per peer, after which its own sends price it (two learned ones
corrected the example above; at 3x, stalls among a busy machine's first direct
sends of 32 descriptors priced direct 3.6x over staging and it was never probed:
426 of 432 sends went staged at 1.2x the direct send's time). A path priced
slower is not shut out for good:
a few early sends that ran cold (a fresh connection, a process still warming up)
can leave it priced 30-80% over what it takes, past the ordinary bound, while the
other path's own sends keep that one right (in one sweep: 32 x 64 KiB, direct
priced 3.5 ms from 3 learned sends, taking 1.9, staged taking 2.9 with its
scatter, chosen at every send). So the bound grows the longer the path goes
untaken: `PROBE_MAX_LOSS` times the whole probe intervals since it was last
chosen, up to `STALE_STEPS` (16) of them (400%, the young bound). A path
priced 50% slower is probed once per 128 choices, 100% slower once per 256,
4x slower once per 768: at most 0.4% of the sends' time by the model, and the
figures of a path priced up to 5x slower can always be corrected. A probe's
send that comes in at least `PROBE_MAX_LOSS` under its price is followed by
another probe at the next choice (where priced at most 5x slower), up to
`FOLLOW_UPS` (4) in a row: each such send pulls the fit (a send under its
price weighs fully), so a price several sends had set wrong is corrected in a
few probes, and the evidence says that path is the faster one.

**Overrides.** When `GPU_PLANNER_STAGING_MIN_DESCRIPTORS` or
`GPU_PLANNER_STAGING_MAX_MEAN_BYTES` is set in the environment (`settings.explicit`),
the gate of both decides instead (the one not set at its default), as before
the model: the benchmarks and a user who wants a fixed gate keep it. Both
prices are still computed, and counted.

**Counted** (`counters`): every priced send by the path it took and why
(`gpu_planner:paths_chosen_total{path, reason}`, counted by the staged send's
`decide`: a staged choice whose request does not line up goes direct, under
that reason), and for every observed send
its predicted and observed seconds by path (`..._predicted_seconds_total`,
`..._observed_seconds_total`, `..._observed_sends_total`, and the histogram
`gpu_planner:path_observed_over_predicted{path}`). The prediction compared is
the prefill's part, what the send's time holds (a staged send's scatter aside).

The staged send calls `choose` once per send whose buffers it could stage (the
decode offered staging; whether the request lines up is looked up only for a
send priced faster staged) and `observe` when a send to that peer
completed, either path, with what it handed Mooncake (descriptors, or the
staged send's pieces), its bytes and its wall time on the prefill. A send that
no probe takes, with no solve due (all but a few in a hundred once a peer's
paths are learned), is chosen without the lock, from the peer's last solved
figures, and a send not learned from is kept without it: the same choice and
figures, and no wait on the transfer threads that send to other peers (with
fewer calls: the observation 6 -> 4 us cold in `bench.staged_send` at
32 descriptors, of a 0.55-0.6 ms send).
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from gpu_planner import settings
from gpu_planner.integration.sglang import counters

DIRECT = "direct"
STAGED = "staged"
PATHS = (DIRECT, STAGED)
_DIRECT_INDEX, _STAGED_INDEX = PATHS.index(DIRECT), PATHS.index(STAGED)

MAX_PEERS = 256  # peers whose figures are kept (least recently used dropped)
HALF_LIFE = 32  # observations of one path to one peer after which a send weighs half
SOLVE_EVERY = 8  # past a peer's first HALF_LIFE sends, its choices solve once per 8 observations
# (and its observations are folded into the sums 8 at a time, or at a solve)
PROBE_MAX_LOSS = 0.25  # a probe's path is priced at most this much slower than the other,
STALE_STEPS = 16  # times the whole probe intervals since it was last taken, up to this many
FOLLOW_UPS = 4  # probes in a row, at most, of a path whose probes came in under their price
# While a path has few of its own sends learned at a peer (seeds measured elsewhere can be
# several times off), a probe may take it sooner and further from the crossover, a few times:
YOUNG_SENDS = 5  # learned sends of a path after which it is no longer young (one stall
# among three, 4x its time, kept direct priced 2x over its time at 32 x 1 KiB for 190 sends)
YOUNG_PROBES = 4  # young probes of a path per peer, at most
YOUNG_PROBE_EVERY = 2  # choices since the path was last taken before a young probe
YOUNG_MAX_LOSS = 4.0  # a young probe's path is priced at most this much slower
# Past a path's first HALF_LIFE learned sends at a peer, its sends are learned from once per
# this much of their time (a probe's always): learning one costs about 25 us after a transfer
# left the caches cold, so the model takes at most about 1% of the time of the sends it prices.
LEARN_EVERY_S = 2e-3
NOISE = 0.3  # relative spread of one send's time around its price (weighs data against seeds)
SEED_SPREAD = 1.0  # a seed's relative uncertainty (the prior's width)

PRICED_SLOWER = "staging priced slower"
PRICED_FASTER = "staging priced faster"

_DECAY = 0.5 ** (1 / HALF_LIFE)
# The learned figures, as a vector: seconds per send (direct, staged), per request, per byte
# direct, per byte staged. Clamped to these ranges (1 MB/s-10 TB/s, 10 ns-10 ms requests,
# fixed costs up to 1 s) unless a seed lies outside them.
_LOWER = (0.0, 0.0, 1e-8, 1e-13, 1e-13)
_UPPER = (1.0, 1.0, 1e-2, 1e-6, 1e-6)
_SCALE_FLOOR = (1e-5, 1e-5, 1e-7, 1e-13, 1e-13)  # a zero seed still learns
_LEARNED = len(_LOWER)


@dataclass(frozen=True)
class Figures:
    """One peer's figures (or the seeds): what each path costs, in seconds and bytes per second."""

    direct_fixed_s: float
    staged_fixed_s: float
    request_s: float
    link_bytes_per_s: float  # the direct path's bytes
    staged_bytes_per_s: float  # the staged path's bytes: gathered and written in pieces
    scatter_fixed_s: float
    scatter_bytes_per_s: float
    sends: tuple[int, int] = (0, 0)  # successful sends learned from: direct, staged

    @classmethod
    def seeded(cls) -> Figures:
        """The seeds the settings give (docs/settings.md: measured on the 2-core CPU, TCP)."""
        link = settings.loaded(settings.COST_LINK_GB_S) * 1e9
        gather = settings.loaded(settings.COST_GATHER_GB_S) * 1e9
        return cls(
            direct_fixed_s=settings.loaded(settings.COST_DIRECT_FIXED_US) / 1e6,
            staged_fixed_s=settings.loaded(settings.COST_STAGED_FIXED_US) / 1e6,
            request_s=settings.loaded(settings.COST_REQUEST_US) / 1e6,
            link_bytes_per_s=link,
            staged_bytes_per_s=1 / (1 / link + 1 / gather),  # gathered, then on the link
            scatter_fixed_s=settings.loaded(settings.COST_SCATTER_FIXED_US) / 1e6,
            scatter_bytes_per_s=settings.loaded(settings.COST_SCATTER_GB_S) * 1e9,
        )

    def direct_s(self, descriptors: int, nbytes: int) -> float:
        """A direct send of `descriptors` moving `nbytes`."""
        return self.direct_fixed_s + self.request_s * descriptors + nbytes / self.link_bytes_per_s

    def staged_send_s(self, pieces: int, nbytes: int) -> float:
        """The prefill's part of a staged send: gather, `pieces` requests, the wire."""
        return self.staged_fixed_s + self.request_s * pieces + nbytes / self.staged_bytes_per_s

    def scatter_s(self, nbytes: int) -> float:
        """The decode's scatter of a staged send's `nbytes` (a figure, never observed here)."""
        return self.scatter_fixed_s + nbytes / self.scatter_bytes_per_s

    def staged_s(self, pieces: int, nbytes: int) -> float:
        """A staged send, the decode's scatter included."""
        return self.staged_send_s(pieces, nbytes) + self.scatter_s(nbytes)

    def send_s(self, path: str, requests: int, nbytes: int) -> float:
        """What the prefill sees of a send on `path`: its time from choice to completion."""
        if path == DIRECT:
            return self.direct_s(requests, nbytes)
        return self.staged_send_s(requests, nbytes)

    def stages_from(self, mean_bytes: int, slot_bytes: int, limit: int = 1 << 20) -> int | None:
        """The fewest descriptors of `mean_bytes` from which staging is priced faster (None: never).

        `slot_bytes` is a staged piece's most (the send staging's slot).
        """

        def staged_wins(descriptors: int) -> bool:
            nbytes = descriptors * mean_bytes
            pieces = staged_pieces(nbytes, slot_bytes)
            return self.staged_s(pieces, nbytes) < self.direct_s(descriptors, nbytes)

        high = 1
        while not staged_wins(high):
            high *= 2
            if high > limit:
                return None
        low = high // 2  # loses (or 0)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if staged_wins(middle) else (middle, high)
        return high

    def describe(self) -> tuple[str, str]:
        """(direct, staged): each path's figures as one line."""
        direct = (
            f"{self.direct_fixed_s * 1e3:.2f} ms + {self.request_s * 1e6:.1f} us per descriptor"
            f" + bytes at {self.link_bytes_per_s / 1e9:.2f} GB/s"
        )
        staged = (
            f"{self.staged_fixed_s * 1e3:.2f} ms + {self.request_s * 1e6:.1f} us per piece"
            f" + bytes gathered and written at {self.staged_bytes_per_s / 1e9:.2f} GB/s,"
            f" scattered (decode) in "
            f"{self.scatter_fixed_s * 1e3:.2f} ms + bytes at "
            f"{self.scatter_bytes_per_s / 1e9:.2f} GB/s"
        )
        return direct, staged

    def _learned(self) -> list[float]:
        return [
            self.direct_fixed_s,
            self.staged_fixed_s,
            self.request_s,
            1 / self.link_bytes_per_s,
            1 / self.staged_bytes_per_s,
        ]


def staged_pieces(nbytes: int, slot_bytes: int) -> int:
    """How many slot-sized pieces a staged send of `nbytes` takes (at least one)."""
    return max(1, -(-nbytes // slot_bytes)) if slot_bytes > 0 else 1


class Choice(NamedTuple):
    """One send's path, both prices (seconds; staged with the decode's scatter) and why."""

    path: str
    direct_s: float
    staged_s: float
    reason: str  # what a send that is not staged is counted under

    @property
    def staged(self) -> bool:
        return self.path == STAGED


@dataclass(frozen=True)
class Gate:
    """Today's gate, where a user set one of its knobs: it decides instead of the model."""

    min_descriptors: int
    max_mean_bytes: int

    @classmethod
    def overriding(cls) -> Gate | None:
        """The gate when `GPU_PLANNER_STAGING_MIN_DESCRIPTORS` or `..._MAX_MEAN_BYTES` is set."""
        knobs = (settings.STAGING_MIN_DESCRIPTORS, settings.STAGING_MAX_MEAN_BYTES)
        if not any(settings.explicit(knob) for knob in knobs):
            return None
        return cls(*(settings.loaded(knob) for knob in knobs))

    def refusal(self, descriptors: int, nbytes: int) -> str | None:
        """Why the gate sends this direct; None: it stages."""
        if descriptors < self.min_descriptors:
            knob = settings.STAGING_MIN_DESCRIPTORS.name
            return f"below the gate: fewer than {knob} descriptors"
        if nbytes > descriptors * self.max_mean_bytes:
            knob = settings.STAGING_MAX_MEAN_BYTES.name
            return f"below the gate: mean descriptor above {knob}"
        return None

    def describe(self) -> str:
        return (
            f"the gate: sends of >= {self.min_descriptors} descriptors of "
            f"<= {self.max_mean_bytes} bytes on average stage"
        )


PASSES_GATE = "passes the gate (GPU_PLANNER_STAGING_* set)"


# The learned figures a path's time holds (indices into the figure vector): its fixed cost,
# the request and its bytes. A send's features are zero at the other two, so each path's
# sums are a 3 x 3 block of the fit's 5 x 5 normal matrix.
PATH_FIGURES = ((0, 2, 3), (1, 2, 4))  # direct, staged
_BLOCK = len(PATH_FIGURES[0])


class _Peer:
    """One peer's learning state: fixed size, whatever the number of its sends."""

    __slots__ = (
        "moments", "targets", "sends", "warm", "since", "young_probes", "probed", "follow_up",
        "chain", "unlearned_s", "figures", "unsolved", "pending",
    )  # fmt: skip

    def __init__(self, seeds: Figures) -> None:
        # Per path, Python floats (an observation adds to them without a NumPy call): the sum
        # of w z z^T over its figures (`PATH_FIGURES`), row-major, and of w z y.
        self.moments = [[0.0] * (_BLOCK * _BLOCK) for _ in PATHS]
        self.targets = [[0.0] * _BLOCK for _ in PATHS]
        self.sends = [0, 0]  # successful sends learned from, by path
        self.warm = [False, False]  # a first send of the path came
        self.since = [0, 0]  # choices since each path was last chosen (capped: `_taken`)
        self.young_probes = [0, 0]  # probes of each path while young
        self.probed = [False, False]  # a probe took the path: its next send is learned from
        self.follow_up = [False, False]  # its last probe came in under its price: probe again
        self.chain = [0, 0]  # probes in a row that came in under their price
        self.unlearned_s = [0.0, 0.0]  # time of each path's sends since its last learned one
        self.figures = seeds  # the last solved figures
        self.unsolved = 0  # observations since they were solved
        # Observations not yet in the sums: (path index, requests, bytes, seconds, predicted),
        # at most SOLVE_EVERY (folded in at once).
        self.pending: list[tuple[int, int, int, float, float]] = []


def _young(state: _Peer, index: int) -> bool:
    """Whether path `index` is still priced mostly by its seeds at this peer (probes left)."""
    return state.sends[index] < YOUNG_SENDS and state.young_probes[index] < YOUNG_PROBES


def _solve_every(state: _Peer) -> int:
    """After how many observations a choice solves the peer's figures again."""
    return SOLVE_EVERY if state.sends[0] + state.sends[1] > HALF_LIFE else 1


class PathCosts:
    """Prices each path per peer and picks the cheaper; learns from completed sends. Thread-safe."""

    def __init__(
        self,
        seeds: Figures,
        *,
        gate: Gate | None = None,
        probe_interval: int = 64,
        max_peers: int = MAX_PEERS,
    ) -> None:
        if probe_interval < 0 or max_peers < 1:
            raise ValueError(f"probe_interval {probe_interval}, max_peers {max_peers}")
        self.seeds = seeds
        self.gate = gate
        self.probe_interval = probe_interval
        self.max_peers = max_peers
        # Python floats, not arrays: a solve is a few hundred float operations.
        seed = seeds._learned()
        self._scale = list(map(max, seed, _SCALE_FLOOR))  # the fit solves for figure / scale
        self._path_scales = [[self._scale[i] for i in figures] for figures in PATH_FIGURES]
        self._lower = list(map(min, _LOWER, seed))
        self._upper = list(map(max, _UPPER, seed))
        self._prior = 1 / SEED_SPREAD**2  # the prior's precision on each scaled figure
        self._prior_target = [
            self._prior * x / scale for x, scale in zip(seed, self._scale, strict=True)
        ]
        self._peers: collections.OrderedDict[str, _Peer] = collections.OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls) -> PathCosts:
        """Seeds, override gate and probe interval as the loaded settings give them."""
        return cls(
            Figures.seeded(),
            gate=Gate.overriding(),
            probe_interval=settings.loaded(settings.COST_PROBE_INTERVAL),
        )

    def choose(self, peer: str, descriptors: int, nbytes: int, staged_pieces: int) -> Choice:
        """The path for a send to `peer` of `descriptors` direct, `staged_pieces` staged.

        Deterministic for a given state: the cheaper path (direct on a tie),
        or, at most once per probe interval of this peer's choices, the other
        one where it is priced at most `PROBE_MAX_LOSS` slower per whole
        interval it went untaken (`STALE_STEPS` of them at most); under an
        override gate, the gate's. The caller counts the path the send takes
        (`counters.record_path_choice`: a staged choice may still go direct).
        """
        state = self._peers.get(peer)  # a dict read: atomic; a peer not kept takes the lock
        if state is not None and self.gate is None and state.unsolved < _solve_every(state):
            quick = self._unprobed(state, descriptors, nbytes, staged_pieces)
            if quick is not None:
                return quick
        with self._lock:
            state = self._peer(peer)
            figures = self._figures(state, _solve_every(state))
            direct_s = figures.direct_s(descriptors, nbytes)
            staged_s = figures.staged_s(staged_pieces, nbytes)
            if self.gate is not None:
                refusal = self.gate.refusal(descriptors, nbytes)
                path, reason = (STAGED, PASSES_GATE) if refusal is None else (DIRECT, refusal)
            else:
                path, reason = self._by_price(state, direct_s, staged_s)
        return Choice(path, direct_s, staged_s, reason)

    def _unprobed(
        self, state: _Peer, descriptors: int, nbytes: int, staged_pieces: int
    ) -> Choice | None:
        """`choose`'s answer, without its lock, for a send no probe takes (all but about one
        in `probe_interval` once a peer's paths are learned); None: ask under the lock.

        The same choice as under the lock: the figures are the peer's last
        solved ones (one attribute read; the caller checked that none are due),
        and the probe clocks move as there (a concurrent choice may lose one
        tick: a probe one send later). The peer's recency is kept by its
        choices under the lock and its learned sends.
        """
        figures = state.figures
        direct_s = figures.direct_s(descriptors, nbytes)
        staged_s = figures.staged_s(staged_pieces, nbytes)
        if self._probe(state, direct_s, staged_s) is not None:
            return None
        if staged_s < direct_s:
            self._taken(state, _STAGED_INDEX)
            return Choice(STAGED, direct_s, staged_s, PRICED_FASTER)
        self._taken(state, _DIRECT_INDEX)
        return Choice(DIRECT, direct_s, staged_s, PRICED_SLOWER)

    def _by_price(self, state: _Peer, direct_s: float, staged_s: float) -> tuple[str, str]:
        """The cheaper path, or a probe's (`_probe`); moves the probe clocks (under the lock)."""
        probe = self._probe(state, direct_s, staged_s)
        if probe is None:
            index = _STAGED_INDEX if staged_s < direct_s else _DIRECT_INDEX
            reason = PRICED_FASTER if index == _STAGED_INDEX else PRICED_SLOWER
        else:
            index, reason, young = probe
            state.young_probes[index] += young
            state.probed[index] = True
        self._taken(state, index)
        return PATHS[index], reason

    def _probe(
        self, state: _Peer, direct_s: float, staged_s: float
    ) -> tuple[int, str, bool] | None:
        """Whether a probe takes the path priced slower now: (its index, why, whether it is a
        young path's probe); None: the cheaper path (direct on a tie). Reads the state only.

        A regular probe's path may be priced `PROBE_MAX_LOSS` slower per whole
        probe interval it went untaken (0 within its first); a follow-up's or a
        young path's, `YOUNG_MAX_LOSS`.
        """
        interval = self.probe_interval
        if not interval:
            return None
        if staged_s < direct_s:
            dearer, low, high = _DIRECT_INDEX, staged_s, direct_s
        else:
            dearer, low, high = _STAGED_INDEX, direct_s, staged_s
        since = state.since[dearer]
        if since >= interval:
            loss = PROBE_MAX_LOSS * (since // interval)
            if high <= low * (1 + loss):
                return dearer, f"probe: {PATHS[dearer]} priced slower by at most {loss:.0%}", False
        if high > low * (1 + YOUNG_MAX_LOSS):
            return None
        if state.follow_up[dearer]:
            reason = f"probe: {PATHS[dearer]}, came in under its price, priced slower by at most "
            return dearer, f"{reason}{YOUNG_MAX_LOSS:.0%}", False
        if since >= min(interval, YOUNG_PROBE_EVERY) and _young(state, dearer):
            reason = f"probe: {PATHS[dearer]}, young, priced slower by at most {YOUNG_MAX_LOSS:.0%}"
            return dearer, reason, True
        return None

    def _taken(self, state: _Peer, index: int) -> None:
        """Move the probe clocks: path `index` was chosen, the other is one choice further from
        it (counted up to `STALE_STEPS` probe intervals)."""
        other = 1 - index
        state.since[index] = 0
        state.since[other] = min(state.since[other] + 1, self.probe_interval * STALE_STEPS)
        state.follow_up[index] = False  # taken: no follow-up pending

    def observe(
        self, peer: str, path: str, requests: int, nbytes: int, seconds: float, ok: bool = True
    ) -> bool:
        """Learn from one completed send to `peer`; True when its figures took it.

        `requests` is what the send handed Mooncake (descriptors direct, pieces
        staged), `seconds` its wall time on the prefill. A failed send
        (`ok=False`), or one whose figures are not a time (not finite, not
        positive), changes nothing. Past the path's first `HALF_LIFE` learned
        sends, a send is learned from once its path's sends since the last
        learned one took `LEARN_EVERY_S` (a probe's send always).
        """
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r}")
        if not (ok and requests >= 1 and nbytes >= 0 and math.isfinite(seconds) and seconds > 0):
            return False
        index = PATHS.index(path)
        state = self._peers.get(peer)  # a dict read: atomic
        if state is not None and self._unlearned(state, index, seconds):
            return False
        with self._lock:
            state = self._peer(peer)
            if not state.warm[index]:
                connected = any(state.warm)  # an earlier send of the other path paid Mooncake's
                state.warm[index] = True  # connection; staging has first-use costs of its own
                if path == STAGED or not connected:
                    return False
            if self._unlearned(state, index, seconds):
                return False
            state.unlearned_s[index] = 0.0
            predicted = state.figures.send_s(path, requests, nbytes)  # solved at the last choice
            predicted = max(predicted, 1e-12)
            under = (
                state.probed[index]
                and seconds * (1 + PROBE_MAX_LOSS) < predicted
                and state.chain[index] < FOLLOW_UPS
            )
            state.chain[index] = state.chain[index] + 1 if under else 0
            state.follow_up[index] = under
            state.probed[index] = False
            state.pending.append((index, requests, nbytes, seconds, predicted))
            if len(state.pending) >= SOLVE_EVERY:
                self._fold(state)
            state.sends[index] += 1
            state.unsolved += 1  # solved at a later choice: an observation costs no solve
        counters.record_path_time(path, predicted, seconds)
        return True

    def _unlearned(self, state: _Peer, index: int, seconds: float) -> bool:
        """Whether a send of path `index` is not learned from: past the path's first
        `HALF_LIFE` learned sends, not a probe's, and its sends since the last learned one
        (kept here) short of `LEARN_EVERY_S`. False changes nothing: the send is learned from.

        `observe` asks first without the lock (most sends end there); a
        concurrent send may lose the other's time: the path is learned from
        one send later.
        """
        if not state.warm[index] or state.sends[index] < HALF_LIFE or state.probed[index]:
            return False
        unlearned_s = state.unlearned_s[index] + seconds
        if unlearned_s >= LEARN_EVERY_S:
            return False
        state.unlearned_s[index] = unlearned_s
        return True

    def _fold(self, state: _Peer) -> None:
        """Add the pending observations to the sums, in order.

        Each observation's features are its terms' prices at the seeds' scale
        (the fit solves for figure / scale); it weighs 1 / (price^2 q^2 NOISE^2)
        for a time over its price by a factor q (q = 1 under it), and every later observation of
        its path decays it by `_DECAY`, on the 3 x 3 block of its path.
        """
        for index, requests, nbytes, seconds, predicted in state.pending:
            fixed, per_request, per_byte = self._path_scales[index]
            features = (fixed, per_request * requests, per_byte * nbytes)
            ratio = seconds / predicted
            off = max(ratio, 1.0)  # noise only adds time: a send under its price weighs fully
            weight = 1.0 / (predicted * predicted * off * off * NOISE * NOISE)
            moments, targets = state.moments[index], state.targets[index]
            for row, feature in enumerate(features):
                weighted = weight * feature
                targets[row] = targets[row] * _DECAY + weighted * seconds
                for column, other in enumerate(features):
                    cell = row * _BLOCK + column
                    moments[cell] = moments[cell] * _DECAY + weighted * other
        state.pending.clear()

    def figures(self, peer: str | None = None) -> Figures:
        """`peer`'s current figures (the seeds for a peer not kept, or without one)."""
        with self._lock:
            state = None if peer is None else self._peers.get(peer)
            return self.seeds if state is None else self._figures(state)

    def peers(self) -> list[str]:
        """The peers kept, least recently used first."""
        with self._lock:
            return list(self._peers)

    def state_bytes(self) -> int:
        """Bytes of the learning state, 8 per number kept (its pending observations at their
        most, `SOLVE_EVERY`): bounded by `max_peers`, not by sends."""
        pending_numbers = SOLVE_EVERY * 5
        with self._lock:
            return 8 * sum(
                sum(map(len, state.moments)) + sum(map(len, state.targets)) + pending_numbers
                for state in self._peers.values()
            )

    def _peer(self, peer: str) -> _Peer:
        state = self._peers.get(peer)
        if state is None:
            state = self._peers[peer] = _Peer(self.seeds)
            while len(self._peers) > self.max_peers:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(peer)
        return state

    def _solve(self, state: _Peer) -> list[float]:
        """The ridge fit of the state's sums: the five figures, scaled (figure / scale).

        Its normal equations are the prior (`_prior` on the diagonal) plus
        each path's 3 x 3 block (fixed, request, bytes); the two blocks share
        only the request figure. So each path's (fixed, bytes) pair is
        eliminated onto the request figure (a Schur complement: 2 x 2
        inverses), the request figure solved, and the pairs back-substituted:
        about 60 float operations, where a general 5 x 5 solve in Python took
        five times as long.
        """
        prior, prior_target = self._prior, self._prior_target
        request_matrix, request_target = prior, prior_target[2]
        pairs = []
        for (fixed, _, per_byte), m, t in zip(
            PATH_FIGURES, state.moments, state.targets, strict=True
        ):
            # The pair's block [[a, b], [c, d]], its columns' request terms (m[1], m[7]),
            # the request row's terms (m[3], m[5]) and the pair's targets (y0, y1).
            a, b, c, d = m[0] + prior, m[2], m[6], m[8] + prior
            determinant = a * d - b * c
            y0, y1 = t[0] + prior_target[fixed], t[2] + prior_target[per_byte]
            u0, u1 = (d * y0 - b * y1) / determinant, (a * y1 - c * y0) / determinant
            v0 = (d * m[1] - b * m[7]) / determinant
            v1 = (a * m[7] - c * m[1]) / determinant
            request_matrix += m[4] - (m[3] * v0 + m[5] * v1)
            request_target += t[1] - (m[3] * u0 + m[5] * u1)
            pairs.append((u0, u1, v0, v1))
        request = request_target / request_matrix
        solved = [0.0] * _LEARNED
        solved[2] = request
        for (fixed, _, per_byte), (u0, u1, v0, v1) in zip(PATH_FIGURES, pairs, strict=True):
            solved[fixed], solved[per_byte] = u0 - request * v0, u1 - request * v1
        return solved

    def _figures(self, state: _Peer, every: int = 1) -> Figures:
        """The state's figures, solved again once `every` observations came since the last."""
        if state.unsolved >= every:
            state.unsolved = 0
            self._fold(state)
            learned = [
                min(max(scaled * scale, lower), upper)
                for scaled, scale, lower, upper in zip(
                    self._solve(state),
                    self._scale,
                    self._lower,
                    self._upper,
                    strict=True,
                )
            ]
            seeds = self.seeds
            state.figures = Figures(
                direct_fixed_s=learned[0],
                staged_fixed_s=learned[1],
                request_s=learned[2],
                link_bytes_per_s=1 / learned[3],
                staged_bytes_per_s=1 / learned[4],
                scatter_fixed_s=seeds.scatter_fixed_s,
                scatter_bytes_per_s=seeds.scatter_bytes_per_s,
                sends=(state.sends[0], state.sends[1]),
            )
        return state.figures


_shared: tuple[int, PathCosts] | None = None  # (settings generation, the instance)
_shared_lock = threading.Lock()


def path_costs() -> PathCosts:
    """The process's `PathCosts`, built from the loaded settings (rebuilt when they reload)."""
    global _shared
    shared = _shared  # one read: atomic; every send but the first after a load ends here
    if shared is not None and shared[0] == settings.loaded_generation():
        return shared[1]
    settings.loaded(settings.COST_PROBE_INTERVAL)  # loads the settings if nothing did yet
    generation = settings.generation()
    with _shared_lock:
        if _shared is None or _shared[0] != generation:
            _shared = (generation, PathCosts.from_settings())
        return _shared[1]


@contextlib.contextmanager
def deciding(costs: PathCosts) -> Iterator[PathCosts]:
    """`costs` decides every send of the block instead of the process's instance (benchmarks
    pricing one path against the other, tests); the instance before comes back after."""
    global _shared
    with _shared_lock:
        saved = _shared
        _shared = (settings.generation(), costs)
    try:
        yield costs
    finally:
        with _shared_lock:
            _shared = saved


def forget_path_costs() -> None:
    """Drop the process's instance and every peer's figures (tests)."""
    global _shared
    with _shared_lock:
        _shared = None

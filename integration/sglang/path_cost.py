"""Which path a send to a peer takes, direct or staged, by what each would cost there now.

A send toward a decode that offers receive staging can go two ways: **direct**
(its planned descriptors, one Mooncake request each) or **staged** (gathered
into the prefill's send slots, written as a few slot-sized pieces, scattered
by the decode). `PathCosts` prices both for the send's shape, per peer, and
picks one; `path_costs()` is the process's one instance.

- The prices: `path_fit` (the model's formulas, the per-peer fit of its
  figures from completed sends, its bounds and how it follows a lasting change).
- The choice: `path_policy` (the cheaper path, or a bounded probe of the other).
- Here: the peers kept (at most `MAX_PEERS`, least recently used dropped, each
  a fixed 464 bytes of numbers, about 2 KiB with Python's objects), one lock over
  them (every call takes it: one pricing path), and the override gate.

A send's life in the model: `choose` prices it and proposes a path (pure: it
moves no clock); `taken` says which path the send went (a staged choice can
still go direct) and only it moves the probe clocks; `observe` learns from the
completed send's time. The caller counts the path taken
(`counters.record_path_choice`, with `Choice.reason`: a fixed set of strings).

**Overrides.** When `GPU_PLANNER_STAGING_MIN_DESCRIPTORS` or
`GPU_PLANNER_STAGING_MAX_MEAN_BYTES` is set in the environment
(`settings.explicit`), the gate of both decides instead (the one not set at its
default): both prices are still computed.

**Never raises** on a send: a price that is not a finite positive number (an
overflow of the caller's counts) makes the choice direct, `UNPRICED`.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from gpu_planner import settings
from gpu_planner.integration.sglang import counters
from gpu_planner.integration.sglang.path_fit import (
    DIRECT,
    HALF_LIFE,
    LEARN_EVERY_S,
    MAX_SECONDS,
    NOISE,
    PATHS,
    SEED_SPREAD,
    SHIFT_FACTOR,
    SHIFT_WINDOW,
    SOLVE_EVERY,
    STAGED,
    Figures,
    Limits,
    PathFit,
    PeerFit,
    staged_pieces,
)
from gpu_planner.integration.sglang.path_policy import (
    FOLLOW_UPS,
    PRICED_FASTER,
    PRICED_SLOWER,
    PROBE,
    PROBE_FOLLOW_UP,
    PROBE_MAX_LOSS,
    PROBE_YOUNG,
    REASONS,
    UNPRICED,
    YOUNG_MAX_LOSS,
    YOUNG_PROBE_EVERY,
    YOUNG_PROBES,
    YOUNG_SENDS,
    Choice,
    Probes,
)

__all__ = [
    "DIRECT",
    "FOLLOW_UPS",
    "HALF_LIFE",
    "LEARN_EVERY_S",
    "MAX_PEERS",
    "MAX_SECONDS",
    "NOISE",
    "PASSES_GATE",
    "PATHS",
    "PRICED_FASTER",
    "PRICED_SLOWER",
    "PROBE",
    "PROBE_FOLLOW_UP",
    "PROBE_MAX_LOSS",
    "PROBE_YOUNG",
    "REASONS",
    "SEED_SPREAD",
    "SHIFT_FACTOR",
    "SHIFT_WINDOW",
    "SOLVE_EVERY",
    "STAGED",
    "UNPRICED",
    "YOUNG_MAX_LOSS",
    "YOUNG_PROBES",
    "YOUNG_PROBE_EVERY",
    "YOUNG_SENDS",
    "Choice",
    "Figures",
    "Gate",
    "PathCosts",
    "deciding",
    "path_costs",
    "staged_pieces",
]

MAX_PEERS = 4096  # peers whose figures are kept (least recently used dropped)

BELOW_MIN_DESCRIPTORS = "below the gate: fewer than GPU_PLANNER_STAGING_MIN_DESCRIPTORS descriptors"
ABOVE_MAX_MEAN_BYTES = "below the gate: mean descriptor above GPU_PLANNER_STAGING_MAX_MEAN_BYTES"
PASSES_GATE = "passes the gate (GPU_PLANNER_STAGING_* set)"


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
            return BELOW_MIN_DESCRIPTORS
        if nbytes > descriptors * self.max_mean_bytes:
            return ABOVE_MAX_MEAN_BYTES
        return None

    def describe(self) -> str:
        return (
            f"the gate: sends of >= {self.min_descriptors} descriptors of "
            f"<= {self.max_mean_bytes} bytes on average stage"
        )


class _Peer:
    """One peer's state: its fit and its probe clocks (fixed size, whatever its sends)."""

    __slots__ = ("fit", "probes")

    def __init__(self, seeds: Figures) -> None:
        self.fit = PeerFit(seeds)
        self.probes = Probes()


class PathCosts:
    """Prices each path per peer and proposes one; learns from completed sends. Thread-safe."""

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
        self._limits = Limits(seeds)
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

        Deterministic for a given state, and pure as to the policy (it may solve
        the peer's figures, a cache): `path_policy.Probes.pick`, or under an
        override gate the gate's. Tell `taken` the path the send went.
        """
        with self._lock:
            state = self._peer(peer)
            fit = state.fit
            try:
                direct_s, staged_s = fit.solved(self.seeds, self._limits).prices(
                    descriptors, nbytes, staged_pieces
                )
            except (ArithmeticError, TypeError):
                return Choice(DIRECT, math.inf, math.inf, UNPRICED)
            if not (0 <= direct_s < math.inf and 0 <= staged_s < math.inf):
                return Choice(DIRECT, direct_s, staged_s, UNPRICED)
            if self.gate is not None:
                refusal = self.gate.refusal(descriptors, nbytes)
                if refusal is None:
                    return Choice(STAGED, direct_s, staged_s, PASSES_GATE)
                return Choice(DIRECT, direct_s, staged_s, refusal)
            return state.probes.pick(fit.sends, direct_s, staged_s, self.probe_interval)

    def taken(self, peer: str, choice: Choice, path: str) -> None:
        """The send of `choice` to `peer` went `path` (`choice.path`, or direct where a staged
        choice could not stage): moves the probe clocks; a probe counts where its path went.
        Never raises (a path it does not know changes nothing)."""
        if path not in PATHS:
            return
        with self._lock:
            self._peer(peer).probes.take(choice, PATHS.index(path))

    def observe(
        self, peer: str, path: str, requests: int, nbytes: int, seconds: float, ok: bool = True
    ) -> bool:
        """Learn from one completed send to `peer`; True when its figures took it.

        `requests` is what the send handed Mooncake (descriptors direct, pieces
        staged), `seconds` its wall time on the prefill. A failed send
        (`ok=False`), or one whose figures are not a time (not finite, not
        positive, over `MAX_SECONDS`), changes nothing; which sends are learned:
        `path_fit`.
        """
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r}")
        if not (ok and requests >= 1 and nbytes >= 0 and 0 < seconds <= MAX_SECONDS):
            return False
        index = PATHS.index(path)
        with self._lock:
            state = self._peer(peer)
            try:
                learned = state.fit.observe(
                    index, self._limits, requests, nbytes, seconds, state.probes.probed[index]
                )
            except ArithmeticError:  # counts past what a float carries: not learned
                return False
            if learned is None:
                return False
            price, shift = learned
            state.probes.returned(index, seconds, price, shift)
        counters.record_path_time(path, price, seconds)
        return True

    def figures(self, peer: str | None = None) -> Figures:
        """`peer`'s current figures (the seeds for a peer not kept, or without one)."""
        with self._lock:
            state = None if peer is None else self._peers.get(peer)
            if state is None:
                return self.seeds
            return state.fit.solved(self.seeds, self._limits, every=1)

    def peers(self) -> list[str]:
        """The peers kept, least recently used first."""
        with self._lock:
            return list(self._peers)

    def state_bytes(self) -> int:
        """Bytes of the numbers the learning state keeps, 8 per number: bounded by
        `max_peers`, not by sends."""
        per_peer = 8 * (2 * PathFit.NUMBERS + 6 + 12)  # fits, send counts, probe clocks
        with self._lock:
            return per_peer * len(self._peers)

    def _peer(self, peer: str) -> _Peer:
        state = self._peers.get(peer)
        if state is None:
            state = self._peers[peer] = _Peer(self.seeds)
            while len(self._peers) > self.max_peers:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(peer)
        return state


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

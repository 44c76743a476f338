"""The send-path cost model's policy: which path a priced send takes, and when to probe.

Deterministic: the choice is a function of the peer's state and the send's two
prices. The cheaper path goes, direct on a tie, except where a probe takes the
path priced slower so that its figures stay current:

- **A regular probe**: the dearer path priced at most `PROBE_MAX_LOSS` slower
  per whole probe interval (`GPU_PLANNER_COST_PROBE_INTERVAL` choices of that
  peer) since it was last taken. A path priced r times the cheaper one's price
  (r - 1 slower) is probed once per ceil((r - 1) / PROBE_MAX_LOSS) intervals
  and costs r - 1 of the cheaper send then: by the model, probes of sends of
  one shape cost at most PROBE_MAX_LOSS / interval of the sends' time (0.4% at
  64), whatever r. No path is shut out for good. For this bound a path is
  priced at the greater of its price and its last probe's time (`Probes.over`;
  young probes and follow-ups, bounded in number, go by the price alone):
  a path that got q times slower than its price costs one probe at its new
  time, and its next probes wait as long as that time asks, until its own
  sends have moved its price (`path_fit`: three of its last five).
- **A young path's probe**: while a path has fewer than `YOUNG_SENDS` learned
  sends at the peer (its figures are still mostly the seeds, which can be
  several times off), it is probed when priced at most `YOUNG_MAX_LOSS` slower
  and not taken in the last `YOUNG_PROBE_EVERY` choices, `YOUNG_PROBES` times
  at most per path and peer: a bounded cost, once per peer.
- **A follow-up**: a probe's send that came in at least `PROBE_MAX_LOSS` under
  its price is followed by another probe of its path at the next choice (where
  priced at most `YOUNG_MAX_LOSS` slower), `FOLLOW_UPS` in a row at most: that
  evidence says the path may be the faster one.

A probe's path must actually be taken for it to count: `Probes.take` moves the
clocks, marks the probe and counts a young one, with the path the send went.

The reasons are a fixed set of strings (counter labels: no numbers in them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from gpu_planner.integration.sglang.path_fit import DIRECT_INDEX, PATHS, STAGED, STAGED_INDEX

PROBE_MAX_LOSS = 0.25  # a probe's path priced at most this much slower per untaken interval
FOLLOW_UPS = 4  # probes in a row, at most, of a path whose probes came in under their price
YOUNG_SENDS = 5  # learned sends of a path after which it is no longer young
YOUNG_PROBES = 4  # young probes of a path per peer, at most
YOUNG_PROBE_EVERY = 2  # choices since the path was last taken before a young probe
YOUNG_MAX_LOSS = 4.0  # a young probe's or a follow-up's path priced at most this much slower
MAX_SINCE = 1 << 40  # choices counted since a path was last taken (a bounded integer)

PRICED_SLOWER = "staging priced slower"
PRICED_FASTER = "staging priced faster"
PROBE = "probe: priced slower, within the probe's bound"
PROBE_YOUNG = "probe: a young path"
PROBE_FOLLOW_UP = "probe: its last probe came in under its price"
UNPRICED = "not priced: the model could not price this send"
REASONS = (PRICED_SLOWER, PRICED_FASTER, PROBE, PROBE_YOUNG, PROBE_FOLLOW_UP, UNPRICED)

log = logging.getLogger(__name__)


class Choice(NamedTuple):
    """One send's path, both prices (seconds; staged with the decode's scatter) and why.

    `probe`: the path is a probe's (priced slower); `young`: a young path's probe.
    """

    path: str
    direct_s: float
    staged_s: float
    reason: str  # one of a fixed set: a counter's label
    probe: bool = False
    young: bool = False

    @property
    def staged(self) -> bool:
        return self.path == STAGED


class Probes:
    """One peer's probe clocks and marks, by path."""

    __slots__ = ("since", "young_probes", "probed", "follow_up", "chain", "over")

    def __init__(self) -> None:
        self.since = [0, 0]  # choices taken since each path was last taken (to MAX_SINCE)
        self.young_probes = [0, 0]  # young probes of each path taken
        self.probed = [False, False]  # a probe took the path: its next send is learned from
        self.follow_up = [False, False]  # its last probe came in under its price: probe again
        self.chain = [0, 0]  # probes in a row that came in under their price
        self.over = [1.0, 1.0]  # each path's last probe's time over its price (at least 1)

    def pick(self, sends: Sequence[int], direct_s: float, staged_s: float, interval: int) -> Choice:
        """The path for a send priced `direct_s` and `staged_s`; reads the state only."""
        if staged_s < direct_s:
            cheaper = Choice(PATHS[STAGED_INDEX], direct_s, staged_s, PRICED_FASTER)
            dearer, low, high = DIRECT_INDEX, staged_s, direct_s
        else:
            cheaper = Choice(PATHS[DIRECT_INDEX], direct_s, staged_s, PRICED_SLOWER)
            dearer, low, high = STAGED_INDEX, direct_s, staged_s
        if not interval:
            return cheaper
        since = self.since[dearer]
        reason, young = None, False
        bound = low * (1 + PROBE_MAX_LOSS * (since // interval))
        if since >= interval and high * self.over[dearer] <= bound:
            reason = PROBE
        elif high <= low * (1 + YOUNG_MAX_LOSS):
            if self.follow_up[dearer]:
                reason = PROBE_FOLLOW_UP
            elif (
                since >= min(interval, YOUNG_PROBE_EVERY)
                and sends[dearer] < YOUNG_SENDS
                and self.young_probes[dearer] < YOUNG_PROBES
            ):
                reason, young = PROBE_YOUNG, True
        if reason is None:
            return cheaper
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s of %s: priced %.3g ms against %.3g ms, %d choices since it was taken",
                reason, PATHS[dearer], high * 1e3, low * 1e3, since,
            )  # fmt: skip
        return Choice(PATHS[dearer], direct_s, staged_s, reason, True, young)

    def take(self, choice: Choice, index: int) -> None:
        """The send of `choice` went path `index`: move the clocks; a probe counts only where
        its own path was taken."""
        if choice.probe and PATHS[index] == choice.path:
            self.probed[index] = True
            self.young_probes[index] += choice.young
        other = 1 - index
        self.since[index] = 0
        self.since[other] = min(self.since[other] + 1, MAX_SINCE)
        self.follow_up[index] = False  # taken: no follow-up pending

    def returned(self, index: int, seconds: float, price: float, shift: float) -> None:
        """A learned send of path `index` took `seconds` against `price` (its path then
        re-anchored by `shift`, 1.0: not): a probe's that came in at least `PROBE_MAX_LOSS`
        under it asks for a follow-up; over it, it prices the next probes (`over`)."""
        if self.probed[index]:
            self.over[index] = max(1.0, seconds / (price * shift))
        elif shift != 1.0:
            self.over[index] = 1.0
        under = (
            self.probed[index]
            and seconds * (1 + PROBE_MAX_LOSS) < price
            and self.chain[index] < FOLLOW_UPS
        )
        self.chain[index] = self.chain[index] + 1 if under else 0
        self.follow_up[index] = under
        self.probed[index] = False

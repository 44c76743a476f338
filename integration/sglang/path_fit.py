"""The send-path cost model's fit: what each path costs one peer, learned from its sends.

Per peer (the decode's Mooncake session) and path, in seconds, for a send of
`requests` Mooncake requests moving `nbytes`:

    direct = direct_fixed + request * descriptors + nbytes / link
    staged = staged_fixed + piece * pieces + nbytes / staged_bytes
             (+ scatter_fixed + nbytes / scatter: the decode's, never observed here)

A path's three figures f = (fixed, per request, per byte) are a ridge fit of
its own sends, around an anchor a (the seeds at first). With the path's scale
s = max(a, SCALE_FLOOR) and x = f / s, the fit minimises

    sum_i w_i (y_i - z_i . x)^2 + sum_j (x_j - a_j / s_j)^2 / SEED_SPREAD^2

over the path's learned sends i: z_i = s * (1, requests_i, nbytes_i), y_i its
seconds, and

    w_i = DECAY^(the path's learned sends since i) * r_i / (NOISE^2 p_i^2)

where p_i is the path's price for the send when it was observed (the fit is on
relative error) and r_i its outlier factor. A send's ratio is y_i / p_i; the path
keeps its last `SHIFT_WINDOW` ratios (ones at first), and q is the send's ratio over
their median: r_i = 1 up to q = `OUTLIER`, (OUTLIER / q)^4 beyond. So a send is
judged against its path's recent typical error, not against its price: a lone stall
(q = 100) weighs nothing, while a lasting change moves the median itself and the
sends that show it weigh fully. (Weighed against the price, 1/q^2, a lasting large
slowdown was never learned: docs/benchmarks.md, "The cost model's evidence".)

A lasting change of more than `SHIFT_FACTOR` (the median of the path's last
ratios outside [1/SHIFT_FACTOR, SHIFT_FACTOR]: most of its recent sends that
far off) re-anchors the path: its anchor becomes its figures times that median
(clamped), and its sums and ratios start again. The fit then follows from the
new level at once, whatever the factor (the send that re-anchored it weighs as
priced at that level); a smaller change is learned by the sums within about
`HALF_LIFE` sends.

Bounds: every solved or anchored figure is clamped to `LOWER`..`UPPER` (a
seed outside them widens them); a send's time above `MAX_SECONDS`, not finite
or not positive, is no time and is not learned. Memory is fixed per peer
(`PathFit.NUMBERS` floats per path), whatever the number of sends.

Which sends are learned (`PeerFit.observe`): a peer's first send pays
Mooncake's connection and its first staged one the staging's first use, so
neither is; past a path's first `HALF_LIFE` learned sends, one send per
`LEARN_EVERY_S` of that path's send time (a probe's always), which keeps
learning to about 1% of the time of the sends it learns from.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from gpu_planner import settings

DIRECT = "direct"
STAGED = "staged"
PATHS = (DIRECT, STAGED)
DIRECT_INDEX, STAGED_INDEX = 0, 1

HALF_LIFE = 32  # learned sends of one path after which a send weighs half
SOLVE_EVERY = 8  # past a peer's first HALF_LIFE learned sends, its figures are solved once per
LEARN_EVERY_S = 2e-3  # past a path's first HALF_LIFE learned sends, one learned per this much
NOISE = 0.3  # relative spread of one send's time around its price (weighs data against anchor)
SEED_SPREAD = 1.0  # the anchor's relative uncertainty (the prior's width)
SHIFT_WINDOW = 5  # recent ratios (time over price) kept per path: a median of 3 of 5
SHIFT_FACTOR = 2.0  # their median beyond this factor either way re-anchors the path
OUTLIER = 1.5  # a send over this times its path's recent median ratio weighs (OUTLIER / q)^4
MAX_SECONDS = 3600.0  # a send's time above this is no time (not learned)

# Per path figure (fixed s, s per request, s per byte): the clamps (fixed costs up to a
# minute, requests of 10 ns-10 ms, 1 MB/s-10 TB/s), and the scale's floor (a zero seed learns).
LOWER = (0.0, 1e-8, 1e-13)
UPPER = (60.0, 1e-2, 1e-6)
SCALE_FLOOR = (1e-5, 1e-7, 1e-13)
_TINY = 1e-30  # the least per-byte figure of any seed (a bandwidth stays finite)

DECAY = 0.5 ** (1 / HALF_LIFE)


@dataclass(frozen=True, slots=True)
class Figures:
    """One peer's figures (or the seeds): what each path costs, in seconds and bytes per second.

    `request_s` is a direct send's per descriptor, `piece_s` a staged send's per
    piece (both one Mooncake request; learned apart, seeded alike: None takes
    `request_s`).
    """

    direct_fixed_s: float
    staged_fixed_s: float
    request_s: float
    link_bytes_per_s: float  # the direct path's bytes
    staged_bytes_per_s: float  # the staged path's bytes: gathered and written in pieces
    scatter_fixed_s: float
    scatter_bytes_per_s: float
    piece_s: float | None = None
    sends: tuple[int, int] = (0, 0)  # successful sends learned from: direct, staged

    def __post_init__(self) -> None:
        if self.piece_s is None:
            object.__setattr__(self, "piece_s", self.request_s)

    @classmethod
    def seeded(cls) -> Figures:
        """The seeds the settings give (docs/settings.md)."""
        link = settings.loaded(settings.COST_LINK_GB_S) * 1e9
        gather = settings.loaded(settings.COST_GATHER_GB_S) * 1e9
        request = settings.loaded(settings.COST_REQUEST_US) / 1e6
        return cls(
            direct_fixed_s=settings.loaded(settings.COST_DIRECT_FIXED_US) / 1e6,
            staged_fixed_s=settings.loaded(settings.COST_STAGED_FIXED_US) / 1e6,
            request_s=request,
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
        piece_s: float = self.piece_s  # type: ignore[assignment]  # set in __post_init__
        return self.staged_fixed_s + piece_s * pieces + nbytes / self.staged_bytes_per_s

    def scatter_s(self, nbytes: int) -> float:
        """The decode's scatter of a staged send's `nbytes` (a figure, never observed here)."""
        return self.scatter_fixed_s + nbytes / self.scatter_bytes_per_s

    def staged_s(self, pieces: int, nbytes: int) -> float:
        """A staged send, the decode's scatter included."""
        return self.staged_send_s(pieces, nbytes) + self.scatter_s(nbytes)

    def prices(self, descriptors: int, nbytes: int, pieces: int) -> tuple[float, float]:
        """(`direct_s`, `staged_s`) of one send, in one call (a choice's)."""
        piece_s: float = self.piece_s  # type: ignore[assignment]
        direct = self.direct_fixed_s + self.request_s * descriptors + nbytes / self.link_bytes_per_s
        staged = (self.staged_fixed_s + piece_s * pieces + nbytes / self.staged_bytes_per_s) + (
            self.scatter_fixed_s + nbytes / self.scatter_bytes_per_s
        )
        return direct, staged

    def send_s(self, path: str, requests: int, nbytes: int) -> float:
        """What the prefill sees of a send on `path`: its time from choice to completion."""
        if path == DIRECT:
            return self.direct_s(requests, nbytes)
        return self.staged_send_s(requests, nbytes)

    def path_figures(self, index: int) -> tuple[float, float, float]:
        """Path `index`'s (fixed s, s per request, s per byte)."""
        if index == DIRECT_INDEX:
            return self.direct_fixed_s, self.request_s, 1 / self.link_bytes_per_s
        piece_s: float = self.piece_s  # type: ignore[assignment]
        return self.staged_fixed_s, piece_s, 1 / self.staged_bytes_per_s

    def stages_from(self, mean_bytes: int, slot_bytes: int, limit: int = 1 << 20) -> int | None:
        """The fewest descriptors of `mean_bytes` from which staging is priced faster (None: never).

        `slot_bytes` is a staged piece's most (a send slot's bytes).
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
        piece_s: float = self.piece_s  # type: ignore[assignment]
        direct = (
            f"{self.direct_fixed_s * 1e3:.2f} ms + {self.request_s * 1e6:.1f} us per descriptor"
            f" + bytes at {self.link_bytes_per_s / 1e9:.2f} GB/s"
        )
        staged = (
            f"{self.staged_fixed_s * 1e3:.2f} ms + {piece_s * 1e6:.1f} us per piece"
            f" + bytes gathered and written at {self.staged_bytes_per_s / 1e9:.2f} GB/s,"
            f" scattered (decode) in "
            f"{self.scatter_fixed_s * 1e3:.2f} ms + bytes at "
            f"{self.scatter_bytes_per_s / 1e9:.2f} GB/s"
        )
        return direct, staged


def staged_pieces(nbytes: int, slot_bytes: int) -> int:
    """How many slot-sized pieces a staged send of `nbytes` takes (at least one)."""
    return max(1, -(-nbytes // slot_bytes)) if slot_bytes > 0 else 1


def _median(values: array) -> float:
    return sorted(values)[len(values) // 2]


class Limits:
    """One model's clamps per path figure: `LOWER`..`UPPER`, widened to take its seeds."""

    __slots__ = ("lower", "upper")

    def __init__(self, seeds: Figures) -> None:
        self.lower, self.upper = [], []
        for index in (DIRECT_INDEX, STAGED_INDEX):
            seed = seeds.path_figures(index)
            lower = [min(bound, figure) for bound, figure in zip(LOWER, seed, strict=True)]
            lower[2] = max(lower[2], _TINY)
            self.lower.append(tuple(lower))
            self.upper.append(tuple(max(b, f) for b, f in zip(UPPER, seed, strict=True)))

    def clamp(self, index: int, figures: tuple[float, ...] | list[float]) -> tuple[float, ...]:
        """`figures` of path `index` within its clamps (a figure not a number: its lower)."""
        lower, upper = self.lower[index], self.upper[index]
        return tuple(
            min(max(figure, low), high) if figure == figure else low
            for figure, low, high in zip(figures, lower, upper, strict=True)
        )


class PathFit:
    """One path's fit at one peer: its anchor, scale, decayed sums and recent ratios.

    Its numbers, in one array of doubles: anchor (3), scale (3), the upper
    triangle of sum w z z^T (6: 00 01 02 11 12 22), sum w z y (3) and the ring of
    the last `SHIFT_WINDOW` ratios.
    """

    NUMBERS = 15 + SHIFT_WINDOW
    __slots__ = ("data", "head", "unsolved")

    def __init__(self, anchor: tuple[float, ...]) -> None:
        self.data = array("d", [0.0] * self.NUMBERS)
        self.head = 0  # the ring's next slot
        self.unsolved = 0  # learned sends since the last solve
        self._anchor(anchor)

    def _anchor(self, anchor: tuple[float, ...]) -> None:
        data = self.data
        for j in range(3):
            data[j] = anchor[j]
            data[3 + j] = max(anchor[j], SCALE_FLOOR[j])
        for cell in range(6, 15):
            data[cell] = 0.0
        for cell in range(15, self.NUMBERS):
            data[cell] = 1.0

    def anchor(self) -> tuple[float, float, float]:
        return self.data[0], self.data[1], self.data[2]

    def ratios(self) -> list[float]:
        """The last `SHIFT_WINDOW` ratios, oldest first (ones where fewer were learned)."""
        ring = list(self.data[15:])
        return ring[self.head :] + ring[: self.head]

    def learn(
        self, index: int, limits: Limits, requests: int, nbytes: int, seconds: float, price: float
    ) -> float:
        """Take one send of `seconds` priced `price`; the factor the path re-anchored by (its
        recent ratios' median), 1.0 where it did not."""
        data = self.data
        ratio = seconds / price
        data[15 + self.head] = ratio
        self.head = (self.head + 1) % SHIFT_WINDOW
        typical = _median(data[15:])
        shifted = typical > SHIFT_FACTOR or typical * SHIFT_FACTOR < 1
        shift = 1.0
        if shifted:
            level = self.solve(index, limits)
            self._anchor(limits.clamp(index, [figure * typical for figure in level]))
            typical_before = shift = typical
            ratio /= typical  # the send against the new level
            typical = 1.0
            data[15] = ratio
            self.head = 1
        off = ratio / typical
        if off <= OUTLIER:
            factor = 1.0
        else:
            factor = OUTLIER / off
            factor *= factor
            factor *= factor
        s0, s1, s2 = data[3], data[4], data[5]
        z0, z1, z2 = s0, s1 * requests, s2 * nbytes
        level = price * shift
        weight = factor / (NOISE * NOISE * level * level)
        w0, w1, w2 = weight * z0, weight * z1, weight * z2
        d = DECAY
        data[6] = data[6] * d + w0 * z0
        data[7] = data[7] * d + w0 * z1
        data[8] = data[8] * d + w0 * z2
        data[9] = data[9] * d + w1 * z1
        data[10] = data[10] * d + w1 * z2
        data[11] = data[11] * d + w2 * z2
        data[12] = data[12] * d + w0 * seconds
        data[13] = data[13] * d + w1 * seconds
        data[14] = data[14] * d + w2 * seconds
        if not shifted:
            self.unsolved += 1
            return 1.0
        self.unsolved = 1 << 30
        return typical_before

    def solve(self, index: int, limits: Limits) -> tuple[float, ...]:
        """The ridge fit's figures (fixed s, s per request, s per byte), clamped.

        The normal equations (sums + I / SEED_SPREAD^2) x = targets + anchor / scale /
        SEED_SPREAD^2, a symmetric positive definite 3 x 3 system, by its cofactors.
        """
        (a0, a1, a2, s0, s1, s2, m00, m01, m02, m11, m12, m22, t0, t1, t2) = self.data[:15]
        prior = 1 / (SEED_SPREAD * SEED_SPREAD)
        a, b, c, d, e, f = m00 + prior, m01, m02, m11 + prior, m12, m22 + prior
        y0, y1, y2 = t0 + prior * a0 / s0, t1 + prior * a1 / s1, t2 + prior * a2 / s2
        c00, c01, c02 = d * f - e * e, c * e - b * f, b * e - c * d
        c11, c12, c22 = a * f - c * c, b * c - a * e, a * d - b * b
        determinant = a * c00 + b * c01 + c * c02
        if not determinant > 0 or determinant == float("inf"):
            return limits.clamp(index, (a0, a1, a2))  # cannot happen with the prior; stays put
        x0 = (c00 * y0 + c01 * y1 + c02 * y2) / determinant
        x1 = (c01 * y0 + c11 * y1 + c12 * y2) / determinant
        x2 = (c02 * y0 + c12 * y1 + c22 * y2) / determinant
        self.unsolved = 0
        return limits.clamp(index, (x0 * s0, x1 * s1, x2 * s2))


class PeerFit:
    """One peer's fit: both paths', which of its sends were learned, its last solved figures."""

    __slots__ = ("paths", "sends", "warm", "unlearned_s", "figures")

    def __init__(self, seeds: Figures) -> None:
        self.paths = (
            PathFit(seeds.path_figures(DIRECT_INDEX)),
            PathFit(seeds.path_figures(STAGED_INDEX)),
        )
        self.sends = [0, 0]  # sends learned from, by path
        self.warm = [False, False]  # a first send of the path came
        self.unlearned_s = [0.0, 0.0]  # time of each path's sends since its last learned one
        self.figures = seeds  # the last solved figures

    def solved(self, seeds: Figures, limits: Limits, every: int = 0) -> Figures:
        """The figures, each path solved again once `every` of its sends came since its last
        (0: `SOLVE_EVERY` past the peer's first `HALF_LIFE` learned sends, else 1)."""
        paths = self.paths
        if not every:
            every = SOLVE_EVERY if self.sends[0] + self.sends[1] > HALF_LIFE else 1
        if paths[0].unsolved < every and paths[1].unsolved < every:
            return self.figures
        figures = self.figures
        direct = (
            paths[0].solve(DIRECT_INDEX, limits)
            if paths[0].unsolved >= every
            else figures.path_figures(DIRECT_INDEX)
        )
        staged = (
            paths[1].solve(STAGED_INDEX, limits)
            if paths[1].unsolved >= every
            else figures.path_figures(STAGED_INDEX)
        )
        self.figures = Figures(
            direct_fixed_s=direct[0],
            staged_fixed_s=staged[0],
            request_s=direct[1],
            link_bytes_per_s=1 / direct[2],
            staged_bytes_per_s=1 / staged[2],
            scatter_fixed_s=seeds.scatter_fixed_s,
            scatter_bytes_per_s=seeds.scatter_bytes_per_s,
            piece_s=staged[1],
            sends=(self.sends[0], self.sends[1]),
        )
        return self.figures

    def observe(
        self, index: int, limits: Limits, requests: int, nbytes: int, seconds: float, always: bool
    ) -> tuple[float, float] | None:
        """Learn from one completed send of path `index` (module docstring: which are);
        `always`: a probe's send, learned whenever its path is warm. Returns the price the
        send was compared with (the last solved figures') and the factor its path re-anchored
        by (1.0: none); None: not learned."""
        if not self.warm[index]:
            connected = self.warm[1 - index]  # an earlier send of the other path paid Mooncake's
            self.warm[index] = True  # connection; staging has first-use costs of its own
            if index == STAGED_INDEX or not connected:
                return None
        if not always and self.sends[index] >= HALF_LIFE:
            unlearned_s = self.unlearned_s[index] + seconds
            if unlearned_s < LEARN_EVERY_S:
                self.unlearned_s[index] = unlearned_s
                return None
        self.unlearned_s[index] = 0.0
        price = max(self.figures.send_s(PATHS[index], requests, nbytes), 1e-12)
        shift = self.paths[index].learn(index, limits, requests, nbytes, seconds, price)
        self.sends[index] += 1
        return price, shift

"""A plugin prefill and a plugin decode with different page sizes: connected, planned, checked.

sglang 0.5.23 refuses the pair when the decode fetches the prefill's info
(`CommonKVManager.try_ensure_parallel_info`), and its prefill could not serve
it anyway: the transfer worker cuts the decode's page list by the prefill's
page count and addresses both sides by one page index. Here:

Decode (`DecodePageSizes`, per manager):
- `parallel_info_hook` lets the pair connect where this decode can be served
  (`why_unserved`: plain KV, or state kept per request); anything else keeps
  sglang's refusal, and its error says why.
- Each request's metadata toward a prefill of another page size carries its
  pages in gpu_planner's `Repaged` frame, and none where sglang reads them:
  a plain sglang prefill writes no KV of it (`metadata_frames`).
- A prefill rank's Success counts only if it declares (`Planned`) that it
  planned for this decode's page size, and its chunks covered every sent
  token once, in order, up to the request's last page (`refusal`); anything
  else turns it into Failed, naming both page sizes.

Prefill (`PrefillPageSizes`, one per process: sglang's parsers see no manager):
- the decode's page size comes with its registration; a `Repaged` request
  gets `virtual_pages` in place of its (empty) destination pages: one per
  prefill page position, so that sglang's chunking by prefill pages cuts
  them exactly, with values past any registered buffer;
- a decode's cached prefix that is not a whole number of the prefill's pages
  reaches sglang's prefill rounded down to them (it starts a send only at a
  page), and `Repaged` says how many tokens of the first sent page the decode
  holds: the send skips them;
- the send hooks (generic and head-sliced) resolve a chunk's slice of them
  (`chunk_for`) into the decode's pages (`unit_send`: both sides as pages of
  `gcd` tokens, `gpu_planner.page_geometry`), plan it as any send of that page
  size, and record the tokens it covered, which the rank's Success declares.
  sglang's own code never gets a virtual page: a send the hooks cannot plan
  fails (-1).
- a decode with receive staging lends such a request its part in pages of
  the unit (`receive_staging`); each chunk's decode pages are a view of the
  request's unit pages (`RepagedRoute.decode_unit_pages`), by which the
  staged send finds the part (`prefill_routes`).

What is not served keeps sglang's refusal: state laid out per page (SWA,
DSA, block scales, ...), decode or prefill context parallelism, sglang's own
staging, unified memory, the KV checksum, and DeepSeek-V4's HiSparse pool
(compressed host rows in a page size of their own).
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import threading
from typing import Any

import numpy as np

from gpu_planner.errors import PlanValidationError
from gpu_planner.integration.sglang.fallback import best_effort
from gpu_planner.integration.sglang.page_array_routes import RoutesByPages
from gpu_planner.integration.sglang.page_size_wire import (
    Planned,
    Repaged,
    declared_plan,
    repaged_frames,
)
from gpu_planner.integration.sglang.registered_region import PerManager
from gpu_planner.integration.sglang.staging_warmup import UnitGathers
from gpu_planner.integration.sglang.staging_wire import KV_POLL_FAILED, KV_POLL_SUCCESS
from gpu_planner.page_geometry import PageGeometry, common_unit, unit_count, unit_pages

# State kept per request (one row or slot each), which no page size lays out.
PER_REQUEST_STATES = frozenset({"mamba", "request_row"})
MAX_ROOMS = 1 << 16  # repaged requests a decode tracks at once: bounds the bookkeeping
INT32_MAX = 2**31 - 1
REPAGED_PAGES = "the decode's repaged pages"


# Decode side.


@dataclasses.dataclass(eq=False)
class RepagedRoom:
    """A request this decode sent to a prefill of another page size, and what ranks declared."""

    prefill_page_size: int
    num_pages: int  # the decode's pages sent: its sent tokens end in the last one
    covered_by: set[int] = dataclasses.field(default_factory=set)  # ranks that sent every token
    reported: set[int] = dataclasses.field(default_factory=set)  # ranks whose Success counted


class DecodePageSizes:
    """One decode manager's prefills of another page size, and its requests sent to them."""

    def __init__(self, manager: Any) -> None:
        self.page_size = int(manager.kv_args.page_size)
        self.session = manager.get_session_id()
        self._prefills: dict[str, int] = {}  # bootstrap address: its page size, where not ours
        self._rooms: dict[int, RepagedRoom] = {}
        self._declared: tuple[int, int, Planned | str | None] | None = None
        self._lock = threading.Lock()

    def why_not(self, info: Any) -> str | None:
        """Why a prefill of `info` (another page size) is not served here, or None."""
        if int(getattr(info, "attn_cp_size", 1) or 1) > 1:
            return "prefill context parallelism splits a request's tokens across its ranks"
        return None

    def release(self) -> None:
        """The manager's end (`PerManager`): nothing registered, nothing to give back."""

    def connected(self, bootstrap_addr: str, prefill_page_size: int) -> None:
        with self._lock:
            self._prefills[bootstrap_addr] = prefill_page_size

    def prefill_page_size(self, bootstrap_addr: str) -> int | None:
        """The page size of the prefill at `bootstrap_addr`, None where it is this decode's."""
        return self._prefills.get(bootstrap_addr)

    def request_refusal(self, prefill_page_size: int, prefix: int) -> str | None:
        """Why a request to a prefill of `prefill_page_size` cannot be served, or None."""
        pair = f"prefill page size {prefill_page_size}, decode page size {self.page_size}"
        if prefix % self.page_size:
            return (
                f"gpu_planner: {pair}: the decode's cached prefix of {prefix} tokens is not a "
                "whole number of its own pages, where its page list starts"
            )
        return None

    def sent(self, room: int, prefill_page_size: int, num_pages: int) -> None:
        with self._lock:
            if room not in self._rooms and len(self._rooms) >= MAX_ROOMS:
                self._rooms.pop(next(iter(self._rooms)))  # the oldest: its request long ended
            self._rooms[room] = RepagedRoom(prefill_page_size, num_pages)

    def on_declared(self, room: int, prefill_rank: int, declared: Planned | str | None) -> None:
        """What the status sglang just parsed declared (None: nothing; str: malformed)."""
        with self._lock:
            self._declared = (room, prefill_rank, declared)

    def refusal(self, room: int, status: int, prefill_rank: int, expected_ranks: int) -> str | None:
        """Before sglang applies a rank's status: why its Success must be Failed, else None."""
        with self._lock:
            parsed, self._declared = self._declared, None
            repaged = self._rooms.get(room)
            if status != KV_POLL_SUCCESS or repaged is None:
                return None
            declared = parsed[2] if parsed and parsed[:2] == (room, prefill_rank) else None
            why = self._not_covered(repaged, declared)
            if why is not None:
                return (
                    f"gpu_planner: prefill rank {prefill_rank} (page size "
                    f"{repaged.prefill_page_size}) toward this decode (page size "
                    f"{self.page_size}): {why}"
                )
            if declared.ranges:
                repaged.covered_by.add(prefill_rank)
            repaged.reported.add(prefill_rank)
            all_reported = len(repaged.reported) >= max(expected_ranks, 1)
            if all_reported and repaged.num_pages and not repaged.covered_by:
                return "gpu_planner: every prefill rank declared that it sent this request no KV"
        return None

    def _not_covered(self, repaged: RepagedRoom, declared: Planned | str | None) -> str | None:
        if declared is None:
            return (
                "its Success declares no plan for this decode's page size (a plain sglang "
                "prefill, which cannot serve another page size: it wrote no KV)"
            )
        if isinstance(declared, str):
            return f"its declaration does not parse ({declared})"
        if declared.page_size != self.page_size:
            return f"it planned for page size {declared.page_size}"
        if not declared.ranges:
            return None  # this rank sent the decode no KV (a replica, a dummy rank)
        end = 0
        for first, stop in declared.ranges:
            if first != end:
                return f"its chunks cover tokens up to {end}, then from {first}"
            end = stop
        last_page = ((repaged.num_pages - 1) * self.page_size, repaged.num_pages * self.page_size)
        if not last_page[0] < end <= last_page[1]:
            return f"its chunks end at token {end}, not in the last page {last_page}"
        return None

    def after_status(self, request_status: dict, room: int) -> None:
        """After sglang applied a status: a request that ended is forgotten."""
        if request_status.get(room) in (None, KV_POLL_SUCCESS, KV_POLL_FAILED):
            self.end(room)

    def end(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)


def _new_decode(manager: Any) -> DecodePageSizes | str:
    why = why_unserved(manager)
    return why if why is not None else DecodePageSizes(manager)


DECODES: PerManager[DecodePageSizes] = PerManager(_new_decode)
NOT_ALL_DECODE_HOOKS = "the decode's page-size and receive-staging hooks are not all registered"


def decode_hooks_registered(registered: bool) -> None:
    """Whether every hook a decode needs to serve another page size registered."""
    DECODES.unavailable = None if registered else NOT_ALL_DECODE_HOOKS


def why_unserved(manager: Any) -> str | None:
    """Why this decode cannot be served by a prefill of another page size, or None."""
    kv_args = manager.kv_args
    states = [getattr(state, "value", state) for state in getattr(kv_args, "state_types", ())]
    per_page = [state for state in states if state not in PER_REQUEST_STATES]
    if per_page:
        return f"its state {per_page[0]} is laid out per page of {kv_args.page_size} tokens"
    if getattr(manager, "dcp_size", 1) > 1:
        return "decode context parallelism relays tokens by its own page layout"
    if getattr(manager, "enable_staging", False):
        return "sglang's own staging (SGLANG_DISAGG_STAGING_BUFFER) addresses pages itself"
    if getattr(kv_args, "mla_compression_ratios", None) is not None:
        return (
            "DeepSeek-V4's HiSparse host pages hold compressed rows in a page size of their "
            "own, which the request's metadata does not carry"
        )
    if _setting("memory", "enable_unified_memory"):
        return "unified memory registers one envelope addressed by the decode's page size"
    if _setting("disagg", "disaggregation_enable_kv_checksum"):
        return "the KV checksum digests whole pages of each side's page size"
    return None


def _setting(bag: str, name: str) -> bool:
    """sglang's global setting `name` of config bag `bag`; False (sglang's default) where the
    settings are not initialised (a unit test's manager)."""
    from sglang.srt import runtime_context

    try:
        return bool(getattr(getattr(runtime_context, f"get_{bag}")(), name))
    except Exception:
        return False


@dataclasses.dataclass
class Connecting:
    """A served decode fetching a prefill's info (this thread only), and why the prefill's page
    size was not accepted, if it was not."""

    decode: DecodePageSizes
    refusal: str | None = None


_CONNECTING: contextvars.ContextVar[Connecting | None] = contextvars.ContextVar(
    "gpu_planner_connecting", default=None
)
_SENDING_METADATA: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "gpu_planner_receiver", default=None
)
_PREFILL_PAGE_SIZE = "_gpu_planner_page_size"  # where a served prefill's own page size waits


def parallel_info_hook(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's fetch of a prefill's info, accepting another page size where it is served.

    sglang's check stays for every other case, and its error says why gpu_planner did not serve.
    """
    try:
        decode, why = _decode_of(manager)
    except Exception as error:  # a partial manager: sglang's own check, and why
        decode, why = None, f"its page-size state could not be made ({error!r})"
    connecting = None if decode is None else Connecting(decode)
    token = _CONNECTING.set(connecting)
    try:
        connected = original(manager, *args, **kwargs)
    except RuntimeError as error:
        why = why or (connecting and connecting.refusal)
        if why is None or not str(error).startswith("Page size mismatch"):
            raise
        raise RuntimeError(
            f"{error} (gpu_planner serves other page sizes, not here: {why})"
        ) from error
    finally:
        _CONNECTING.reset(token)
    if decode is not None and connected:
        bootstrap_addr = (list(args) + [kwargs.get("bootstrap_addr")])[0]
        info = manager.prefill_info_table.get(bootstrap_addr)
        prefill_page_size = getattr(info, _PREFILL_PAGE_SIZE, None)
        if prefill_page_size is not None:
            info.page_size = prefill_page_size  # what the prefill said, as sglang keeps it
            decode.connected(bootstrap_addr, prefill_page_size)
    return connected


def _decode_of(manager: Any) -> tuple[DecodePageSizes | None, str | None]:
    """`manager`'s page-size state, or why it has none (None, None: not a decode)."""
    mode = getattr(manager, "disaggregation_mode", None)
    if getattr(mode, "name", None) != "DECODE":
        return None, None
    decode = DECODES.get(manager)
    return (None, decode) if isinstance(decode, str) else (decode, None)


def prefill_info_hook(original: Any, info: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's normalisation of a prefill's info; while a served decode connects, another page
    size passes sglang's check (`parallel_info_hook` puts it back)."""
    result = original(info, *args, **kwargs)
    connecting = _CONNECTING.get()
    page_size = getattr(info, "page_size", None)
    if connecting is None or not isinstance(page_size, int) or page_size < 1:
        return result  # sglang's own check judges it
    if page_size == connecting.decode.page_size:
        return result
    connecting.refusal = connecting.decode.why_not(info)
    if connecting.refusal is None:
        setattr(info, _PREFILL_PAGE_SIZE, page_size)
        info.page_size = connecting.decode.page_size
    return result


def send_metadata_hook(original: Any, receiver: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's sending of a request's metadata; its messages know which prefill they go to."""
    token = _SENDING_METADATA.set(receiver)
    try:
        return original(receiver, *args, **kwargs)
    finally:
        _SENDING_METADATA.reset(token)


@dataclasses.dataclass(frozen=True)
class RepagedMetadata:
    """A request's metadata toward a prefill of another page size, and its pages (None for a
    request Failed here)."""

    frames: list[bytes]
    pages: np.ndarray | None
    device_pages: np.ndarray | None  # HiSparse's device pages, in the decode's page size
    page_size: int  # the decode's
    unit: int  # tokens per page of the prefill's sends: `gcd` of both page sizes

    def unit_pages(self, pages: np.ndarray) -> np.ndarray:
        """`pages` (the request's, of either space) as pages of `unit` tokens, as the prefill's
        sends take them."""
        return request_unit_pages(pages, self.page_size, self.unit)


def request_unit_pages(pages: np.ndarray, page_size: int, unit: int) -> np.ndarray:
    """A repaged request's decode pages (of `page_size` tokens, every one sent from its first
    token) as int64 pages of `unit` tokens: what both sides key a lent part by."""
    tokens, geometry = len(pages) * page_size, PageGeometry(page_size)
    return unit_pages(pages, geometry, unit, tokens, REPAGED_PAGES)


def metadata_frames(original: Any, manager: Any, kwargs: dict) -> RepagedMetadata | None:
    """The metadata toward a prefill of another page size (None: not one): sglang's frames with
    no pages, and the pages in `Repaged`; for a request that cannot be served (or a failure
    here), no pages at all and the request Failed. Never the pages where sglang reads them."""
    # sglang 0.5.23 builds a request's metadata only in `send_metadata` (both fingerprinted).
    receiver = _SENDING_METADATA.get()
    decode = DECODES.existing(manager)
    if receiver is None or decode is None or kwargs.get("is_dummy"):
        return None
    prefill_page_size = decode.prefill_page_size(getattr(receiver, "bootstrap_addr", None))
    if prefill_page_size is None:
        return None
    prefix = int(kwargs.get("decode_prefix_len") or 0)
    held = prefix % prefill_page_size  # tokens of the prefill's first sent page held here
    no_pages = {"kv_indices": np.empty(0, dtype=np.int32), "device_kv_indices": None}
    frames = original(manager, **{**kwargs, **no_pages, "decode_prefix_len": prefix - held})
    room = kwargs["bootstrap_room"]
    unit = math.gcd(prefill_page_size, decode.page_size)
    try:
        pages = np.asarray(kwargs["kv_indices"])
        device_pages = kwargs.get("device_kv_indices")
        device_pages = None if device_pages is None else np.asarray(device_pages)
        refusal = decode.request_refusal(prefill_page_size, prefix)
        if refusal is None:
            added = repaged_frames(pages, held, device_pages)
            decode.sent(int(room), prefill_page_size, len(pages))
            metadata = [*frames, *added]
            return RepagedMetadata(metadata, pages, device_pages, decode.page_size, unit)
    except Exception as error:  # unserved: no KV goes, the request fails
        refusal = f"gpu_planner: a request to a prefill of another page size ({error})"
    from sglang.srt.disaggregation.base.conn import KVPoll

    manager.record_failure(room, refusal)
    manager.update_status(room, KVPoll.Failed)
    return RepagedMetadata(frames, None, None, decode.page_size, unit)


def declared_toward(manager: Any, msg: list[bytes], room: int, prefill_rank: int) -> None:
    """Keep what a parsed status declares toward this decode, for `refusal`."""
    decode = DECODES.existing(manager)
    if decode is not None:
        try:
            declared: Planned | str | None = declared_plan(msg, decode.session)
        except Exception as error:  # a malformed declaration fails the rank's Success
            declared = str(error)
        decode.on_declared(room, prefill_rank, declared)


# Prefill side.


@dataclasses.dataclass(eq=False)
class RepagedRoute:
    """A request whose decode has another page size: its pages, and what this rank planned."""

    room: int
    session: str
    decode_page_size: int
    decode_pages: np.ndarray  # int64: the decode's pages of the sent tokens
    decode_device_pages: np.ndarray | None  # int64: HiSparse's device pages of the same tokens
    prefix: int  # the prefix sglang's prefill skips: its first sent page starts there
    held: int  # tokens of that page the decode holds: sent token 0 is token `prefix + held`
    ranges: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # planned, in order
    _unit_pages: dict[tuple[int, bool], np.ndarray] = dataclasses.field(default_factory=dict)

    def decode_unit_pages(self, unit: int, device: bool = False) -> np.ndarray:
        """The decode's pages (`device`: HiSparse's device pages) of every sent token as pages
        of `unit` tokens, made once per unit: each chunk's are a view of them, by which a part
        of the decode's receive staging lent to the request (in these pages) is found."""
        pages = self._unit_pages.get((unit, device))
        if pages is None:
            decode_pages = self.decode_device_pages if device else self.decode_pages
            assert decode_pages is not None
            pages = request_unit_pages(decode_pages, self.decode_page_size, unit)
            if pages.base is not None:
                pages = pages.copy()  # an array of its own, which a lent part is keyed by
            pages = self._unit_pages.setdefault((unit, device), pages)
        return pages


class PrefillPageSizes:
    """The decodes that declared a page size, and the requests planned for another one."""

    def __init__(self) -> None:
        self.unavailable: str | None = None  # why this process serves no other page size
        self._decodes: dict[str, int] = {}  # decode session: its page size
        self._routes: RoutesByPages[RepagedRoute] = RoutesByPages()  # by its virtual pages
        self._smallest_page_size: int | None = None  # of this process's managers
        self.unit_gathers = UnitGathers()  # compiled at a registration, not in a request
        self._lock = threading.Lock()

    def hooks_registered(self, registered: bool) -> None:
        """Whether every hook a repaged request needs registered: the wire's and the sends'."""
        self.unavailable = (
            None if registered else "the prefill's send and wire hooks are not all registered"
        )

    def manager_built(self, manager: Any) -> None:
        """A prefill manager of this process: its page size bounds the virtual pages' count, and
        its gathers compile for the page sizes decodes declare."""
        page_size = int(manager.kv_args.page_size)
        with self._lock:
            smallest = self._smallest_page_size
            self._smallest_page_size = page_size if smallest is None else min(smallest, page_size)
            if getattr(manager, "dcp_size", 1) > 1:
                self.unavailable = "this prefill relays tokens for decode context parallelism"
        self.unit_gathers.manager_built(manager)

    def registered(self, session: str, page_size: int | None) -> None:
        """Decode `session` declared `page_size` (None: none); what it adds to this process's
        gathers compiles now, on sglang's bootstrap thread, before any of its requests."""
        with self._lock:
            if page_size is None:
                self._decodes.pop(session, None)
            else:
                self._decodes[session] = page_size
        if page_size is not None:
            self.unit_gathers.decode_registered(page_size)

    def decode_page_size(self, session: str) -> int | None:
        """The page size decode `session` declared, if it did (`bench.page_sizes` reads it)."""
        return self._decodes.get(session)

    def repage(self, info: Any, request: Repaged) -> RepagedRoute:
        """Give `info` (a parsed TransferInfo) virtual pages for the decode's `request`."""
        decode_page_size = self._decodes.get(info.mooncake_session_id)
        if self.unavailable is not None or decode_page_size is None:
            why = self.unavailable or "the decode declared no page size"
            raise ValueError(f"a request for another page size is not served here: {why}")
        tokens = request.held + len(request.pages) * decode_page_size
        virtual = virtual_pages(-(-tokens // (self._smallest_page_size or 1)))
        device_pages = request.device_pages
        route = RepagedRoute(
            info.room, info.mooncake_session_id, decode_page_size,
            request.pages.astype(np.int64),
            None if device_pages is None else device_pages.astype(np.int64),
            int(info.decode_prefix_len or 0), request.held,
        )  # fmt: skip
        self._routes.add(virtual, route)
        info.dst_kv_indices = virtual
        if device_pages is not None:  # sglang's worker slices both alike: the sends map both
            info.dst_device_kv_indices = virtual
        return route

    def chunk_for(self, dst_pages: Any) -> tuple[RepagedRoute, int] | None:
        """The repaged request whose virtual pages `dst_pages` slices, and the slice's first
        prefill page position in it; None for any other page list."""
        return self._routes.find(dst_pages)

    def planned(self, route: RepagedRoute, first: int, end: int) -> None:
        """This rank's descriptors for `route` covered its sent tokens `[first, end)`."""
        with self._lock:
            route.ranges.append((first, end))

    def declarations(self, manager: Any, room: int) -> dict[str, Planned]:
        """{decode session: Planned} of `room`'s requests toward decodes of another page size:
        what this rank's Success for `room` declares (no range: it sent that decode no KV)."""
        if not self._decodes:  # no decode declared a page size: nothing to declare
            return {}
        infos = getattr(manager, "transfer_infos", {}).get(room) or {}
        own = getattr(manager.kv_args, "page_size", None)
        declared: dict[str, Planned] = {}
        with self._lock:
            for info in infos.values():
                session = info.mooncake_session_id
                route = self._routes.of(getattr(info, "dst_kv_indices", None))
                if route is not None:
                    declared[session] = Planned(route.decode_page_size, tuple(route.ranges))
                elif info.is_dummy and self._decodes.get(session, own) != own:
                    declared[session] = Planned(self._decodes[session], ())
        return declared

    def forget(self) -> None:
        """Forget every decode and request (tests)."""
        with self._lock:
            self._decodes.clear()
        self._routes.clear()


PREFILL = PrefillPageSizes()


def manager_built_hook(result: None = None, manager: Any = None, *args: Any, **kwargs: Any) -> None:
    """AFTER sglang builds a Mooncake KV manager: a prefill's page size for `PREFILL`."""
    mode = getattr(getattr(manager, "disaggregation_mode", None), "name", None)
    if mode == "PREFILL":
        with best_effort("a prefill's page size was not recorded", "page sizes"):
            PREFILL.manager_built(manager)


def virtual_pages(count: int) -> np.ndarray:
    """`count` int32 page ids at the top of int32: their positions are what the hooks read; as
    pages they lie far past any registered buffer, so no write can land with one."""
    return np.arange(INT32_MAX - count + 1, INT32_MAX + 1, dtype=np.int64).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class UnitSend:
    """One chunk of a repaged request as an equal-page send of `unit`-token pages."""

    src_pages: np.ndarray  # int64 unit pages of the prefill's chunk
    dst_pages: np.ndarray  # int64 unit pages of the decode's
    dst_device_pages: np.ndarray | None  # int64 unit pages of HiSparse's device space
    unit: int
    first: int  # the chunk's sent tokens: [first, end)
    end: int


def sends_no_token(route: RepagedRoute, position: int, num_pages: int, page_size: int) -> bool:
    """Whether the chunk of `num_pages` prefill pages at prefill page `position` of `route`'s
    request holds no token the decode lacks: all of them are in the prefix it holds (sglang's
    prefill starts at the page holding its end), or the decode takes no page at all (its
    prefix covers the prompt). Such a chunk moves nothing, as sglang's own send of no page."""
    chunk_end = (position + num_pages) * page_size
    return chunk_end <= route.held or not len(route.decode_pages)


def unit_send(
    route: RepagedRoute, position: int, src_pages: np.ndarray, page_size: int
) -> UnitSend:
    """The chunk whose prefill pages `src_pages` (of `page_size` tokens) sit at prefill page
    `position` of `route`'s request, as unit pages of both sides.

    Its tokens skip those the decode holds, and end at its last page or the
    decode's, whichever comes first; `PlanValidationError` names what cannot be
    planned.
    """
    decode_page_size = route.decode_page_size
    if route.prefix % page_size or not 0 <= route.held < page_size:
        raise PlanValidationError(
            f"prefix of {route.prefix} tokens and {route.held} held: not a whole number of the "
            f"prefill's pages of {page_size} tokens and part of one"
        )
    chunk_start = position * page_size  # tokens past `route.prefix`
    start = max(chunk_start, route.held)
    stop = min(
        chunk_start + len(src_pages) * page_size,
        route.held + len(route.decode_pages) * decode_page_size,
    )
    if stop <= start:
        raise PlanValidationError(
            f"prefill pages from position {position} lie past the decode's "
            f"{len(route.decode_pages)} pages of {decode_page_size} tokens"
        )
    first, end = start - route.held, stop - route.held  # sent tokens
    src = PageGeometry(page_size, start - chunk_start)
    dst = PageGeometry(decode_page_size, first % decode_page_size)
    unit = common_unit(src, dst)
    sent = slice(first // unit, first // unit + unit_count(end - first, unit))  # unit | first
    device = route.decode_device_pages is not None
    return UnitSend(
        unit_pages(src_pages, src, unit, end - first, "prefill_data_indices"),
        route.decode_unit_pages(unit)[sent],
        route.decode_unit_pages(unit, device=True)[sent] if device else None,
        unit,
        first,
        end,
    )


def unit_len(length: int, page_size: int, unit: int, field: str) -> int:
    """Bytes of a unit page of `unit` tokens, from `length` bytes per page of `page_size`."""
    if length <= 0 or length % page_size:
        raise PlanValidationError(
            f"{field}: {length} bytes are not whole tokens of a page of {page_size}"
        )
    return length // page_size * unit

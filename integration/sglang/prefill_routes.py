"""Receive staging, prefill side: which decodes offer it and which request each lent part is for.

A decode with the plugin advertises its receive staging in its KV
registration and lends each request a part of it in the request's metadata
(`staging_wire`). The hooks on sglang's parsers of those two messages
(`KVArgsRegisterInfo.from_zmq`, `TransferInfo.from_zmq`) keep what a
gpu_planner decode added, checked, in `ROUTES`, and leave sglang's result as
it is; a plain sglang decode adds nothing. sglang's parsers are classmethods
that see no manager, so what they keep lives in one registry object per
process, keyed by the decode's session and by the request's page array.

Which request a send belongs to: sglang hands the send a slice of the
`TransferInfo`'s destination pages; the slice's base array is the one the
parser hook saw, and its offset is the chunk's first page in the request.

The rank's Success status declares how many staged notes it sent for each
lent request (`status_message_hook`): every other chunk went direct, and a
decode whose notes did not all arrive fails the request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_planner.integration.sglang.fallback import best_effort
from gpu_planner.integration.sglang.page_array_routes import RoutesByPages
from gpu_planner.integration.sglang.page_size_wire import (
    planned_frames,
    registered_page_size,
    repaged_request,
)
from gpu_planner.integration.sglang.page_sizes import PREFILL, RepagedRoute
from gpu_planner.integration.sglang.staging_wire import (
    KV_POLL_SUCCESS,
    Capability,
    Reservation,
    declared_frames,
)


@dataclass(eq=False)
class Route:
    """Where one request's staged bytes go, whom to tell, and how many notes it was told."""

    room: int
    session: str
    endpoint: str
    port: int
    region: Capability
    reservation: Reservation
    # A lent page as a fraction of the decode's page (tokens of a lent page, the decode's page
    # size): a repaged request's part is lent in the pages its sends take (`page_sizes`).
    lent_page: tuple[int, int] = (1, 1)
    staged_notes: int = 0  # notes sent for this request: its Success status declares them


class StagingRoutes:
    """The decodes that advertised receive staging, and the parts lent to live requests."""

    def __init__(self) -> None:
        self._peers: dict[str, Capability] = {}  # decode session -> its advertised region
        self._routes: RoutesByPages[Route] = RoutesByPages()  # by the pages a send takes
        # A repaged request's routes by its TransferInfo's (virtual) pages: what its status
        # declares is found from them (its sends take the decode's pages, `page_sizes`).
        self._repaged: RoutesByPages[Route] = RoutesByPages()
        self._lock = threading.Lock()

    def advertised(self, session: str, capability: Capability | None) -> None:
        """`session`'s registration advertised `capability` (None: nothing, or ignored)."""
        with self._lock:
            if capability is None:
                self._peers.pop(session, None)
            else:
                self._peers[session] = capability

    def capability(self, session: str) -> Capability | None:
        """The region `session` advertised, if any (one dict read: no lock)."""
        return self._peers.get(session)

    def lend(self, pages: np.ndarray, route: Route, virtual: np.ndarray | None = None) -> None:
        """`pages` (a TransferInfo's destination pages, or a repaged request's decode pages
        beside its `virtual` ones) belong to `route` while they live."""
        self._routes.add(pages, route)
        if virtual is not None:
            self._repaged.add(virtual, route)

    def route_for(self, dst_pages: np.ndarray) -> tuple[Route, int] | None:
        """The request `dst_pages` (a slice of its metadata's pages) belongs to, and its first
        page in that request."""
        return self._routes.find(dst_pages)

    def note_sent(self, route: Route) -> None:
        """One more staged note went to `route`'s request."""
        with self._lock:
            route.staged_notes += 1

    def declarations(self, manager: Any, room: int) -> dict[tuple[str, int], int]:
        """{(decode session, reservation id): staged notes sent} of `room`'s lent requests:
        what this rank's Success status for `room` declares."""
        infos = getattr(manager, "transfer_infos", {}).get(room) or {}
        declared = {}
        with self._lock:
            for info in infos.values():
                pages = getattr(info, "dst_kv_indices", None)
                route = self._routes.of(pages) or self._repaged.of(pages)
                if route is not None:
                    declared[route.session, route.reservation.reservation_id] = route.staged_notes
        return declared

    @property
    def lent_requests(self) -> int:
        """Requests with a part lent that are still alive."""
        return len(self._routes)

    def forget(self) -> None:
        """Forget every advertised region and lent part (tests)."""
        with self._lock:
            self._peers.clear()
        self._routes.clear()
        self._repaged.clear()


ROUTES = StagingRoutes()


def registration_info_hook(original: Any, cls: Any, msg: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's parse of a decode's registration; keeps the receive staging it advertised and
    the page size it declared."""
    info = original(cls, msg, *args, **kwargs)
    page_size = None
    with best_effort("a decode's page size was ignored", "page size ignored"):
        page_size = registered_page_size(msg)
    PREFILL.registered(getattr(info, "mooncake_session_id", None), page_size)
    capability = None
    with best_effort(
        "a decode's receive-staging advertisement was ignored", "staging advertisement ignored"
    ):
        capability = _advertised(msg, info)
    ROUTES.advertised(getattr(info, "mooncake_session_id", None), capability)
    return info


def _advertised(msg: Any, info: Any) -> Capability | None:
    """The region the registration `msg` advertises; `ValueError` when it overlaps what else
    the decode registered.

    sglang's registration carries each buffer's base (KV, aux, state, its own
    staging) and each KV buffer's page length, not its size: no base may lie
    inside the region, nor the region inside a KV buffer's first page.
    """
    capability = Capability.from_registration(msg)
    if capability is None:
        return None
    start, end = capability.address, capability.address + capability.nbytes
    kv_ptrs = [int(ptr) for ptr in info.dst_kv_ptrs]
    item_lens = list(info.dst_kv_item_lens) or [int(info.dst_kv_item_len)] * len(kv_ptrs)
    state_ptrs = [int(ptr) for ptrs in info.dst_state_data_ptrs for ptr in ptrs]
    bases = kv_ptrs + [int(ptr) for ptr in info.dst_aux_ptrs] + state_ptrs
    bases += [int(info.staging_base_ptr)] if info.staging_base_ptr else []
    inside = [base for base in bases if start <= base < end]
    first_pages = [
        (ptr, ptr + int(item_len))
        for ptr, item_len in zip(kv_ptrs, item_lens, strict=False)
        if ptr < end and start < ptr + int(item_len)
    ]
    if inside or first_pages:
        at = inside[0] if inside else first_pages[0][0]
        raise ValueError(
            f"{capability.nbytes} bytes at {start} overlap the decode's registered buffer at {at}"
        )
    return capability


def transfer_info_hook(original: Any, cls: Any, msg: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's parse of a request's metadata; a request for another page size gets virtual
    pages (`page_sizes`), any other keeps the part of the region lent to it."""
    info = original(cls, msg, *args, **kwargs)
    # Unserved (no hook, a malformed frame): the request keeps sglang's empty page list, no
    # KV goes, and the decode fails it when this rank's Success declares no plan.
    repaged = None
    with best_effort("a request for another page size was not served", "repaged not served"):
        request = None if info.is_dummy else repaged_request(msg)
        if request is not None:
            repaged = PREFILL.repage(info, request)
    with best_effort(
        "a decode's receive-staging reservation was ignored", "staging reservation ignored"
    ):
        region = ROUTES.capability(info.mooncake_session_id)
        reservation = None if region is None else Reservation.from_metadata(msg, region)
        if reservation is None or info.is_dummy:
            return info
        pages, lent_page, virtual = info.dst_kv_indices, (1, 1), None
        if repaged is not None:
            unit = _lent_unit(repaged, reservation)
            pages = repaged.decode_unit_pages(unit)  # the pages the request's sends view
            lent_page, virtual = (unit, repaged.decode_page_size), info.dst_kv_indices
        if reservation.pages != len(pages):
            raise ValueError(f"{reservation.pages} pages lent for {len(pages)} pages")
        route = Route(
            info.room, info.mooncake_session_id, info.endpoint, info.dst_port, region,
            reservation, lent_page,
        )  # fmt: skip
        ROUTES.lend(pages, route, virtual)
    return info


def _lent_unit(repaged: RepagedRoute, reservation: Reservation) -> int:
    """The tokens of each page the decode lent `repaged`'s part in (the `gcd` of both page
    sizes, which its sends take); `ValueError` where no such unit fills the request."""
    tokens = len(repaged.decode_pages) * repaged.decode_page_size
    pages = reservation.pages
    if not pages or tokens % pages or repaged.decode_page_size % (tokens // pages):
        raise ValueError(f"{pages} pages lent for {tokens} tokens in pages of a common unit")
    return tokens // pages


def status_message_hook(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's status message; a Success declares the notes sent for each lent request and
    what was planned for each decode of another page size."""
    parts = original(manager, *args, **kwargs)
    # Nothing declared on an error: a decode that got notes, or has another page size,
    # fails the request.
    with best_effort("a status declared nothing", "not declared"):
        if int(kwargs.get("status", -1)) != KV_POLL_SUCCESS or args:
            return parts
        room = kwargs["bootstrap_room"]
        declared, planned = ROUTES.declarations(manager, room), PREFILL.declarations(manager, room)
        added = (declared_frames(declared) if declared else []) + (
            planned_frames(planned) if planned else []
        )
        if not added:
            return parts
        reason = [] if manager.kv_status_msg_carries_reason else [b""]  # sglang reads frame 3
        return [*parts, *reason, *added]
    return parts

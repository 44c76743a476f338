"""`RoutesByPages`: a route found again from any contiguous slice of its array, only while the
array lives, and never from another array holding the same pages."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from gpu_planner.integration.sglang.page_array_routes import RoutesByPages


def test_a_route_is_found_from_contiguous_slices_of_its_own_array_only():
    routes: RoutesByPages[str] = RoutesByPages()
    pages = np.arange(10, dtype=np.int32)
    routes.add(pages, "request")
    assert routes.of(pages) == "request" and routes.find(pages) == ("request", 0)
    assert routes.find(pages[3:7]) == ("request", 3)
    assert routes.find(pages[2:][1:3]) == ("request", 3)
    assert routes.find(pages[9:]) == ("request", 9)
    for other in (pages[::2], pages[1::3], pages.copy(), pages.view(np.uint32)[3:7], [1, 2]):
        assert routes.find(other) is None
    assert routes.of(pages[:]) is None  # a view is not the registered array
    with pytest.raises(ValueError, match="view another array"):
        routes.add(pages[2:], "a view")


def test_a_route_ends_with_its_array_and_a_reused_id_finds_nothing():
    routes: RoutesByPages[str] = RoutesByPages()
    pages = np.arange(4, dtype=np.int64)
    routes.add(pages, "first")
    routes.add(pages, "again")  # the same array registered anew: the newer route
    assert routes.of(pages) == "again" and len(routes) == 1
    del pages
    gc.collect()
    assert len(routes) == 0
    later = np.arange(4, dtype=np.int64)
    assert routes.find(later) is None and routes.of(later) is None

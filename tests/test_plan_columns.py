"""The arrays hand-off's views (`batch_columns`, `buffer_batch_columns`) on every backend.

They must hold exactly the reference's descriptors, batch by batch and buffer by
buffer, as contiguous int64 views of the plan's host columns (no copy).
"""

from __future__ import annotations

import numpy as np
import test_plan
from hypothesis import given
from hypothesis import strategies as st
from pages_strategies import layouts, page_lists


def assert_views_of(columns: np.ndarray, *views: np.ndarray) -> None:
    for view in views:
        assert view.dtype == np.int64 and view.flags.c_contiguous
        assert view.size == 0 or np.shares_memory(view, columns)


@given(
    pages=page_lists(),
    layout=layouts(),
    max_batch_pages=st.sampled_from(test_plan.BATCH_LIMITS),
)
def test_column_views_match_reference(backend_device, pages, layout, max_batch_pages):
    backend, device = backend_device
    result = test_plan.plan(pages, layout, max_batch_pages, backend, device)
    columns = result.columns_array()
    views = [piece[2:] for piece in result.pieces()]
    expected = test_plan.expected_batches(pages, layout, max_batch_pages)
    assert [tuple(view.tolist() for view in batch) for batch in views] == expected
    for batch in views:
        assert_views_of(columns, *batch)
    pieces = list(result.pieces(per_buffer=True))
    assert [
        (p.batch, p.buffer, p.srcs.tolist(), p.dsts.tolist(), p.lens.tolist()) for p in pieces
    ] == [tuple(piece) for piece in result.pieces(per_buffer=True, lists=True)]
    for piece in pieces:
        assert_views_of(columns, piece.srcs, piece.dsts, piece.lens)

"""The compiled head-slice descriptor builder against per-token Python ints, and its refusals."""

from __future__ import annotations

import contextlib
import doctest

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpu_planner as gp
from gpu_planner import head_slices
from gpu_planner.head_slices import INT64_MAX, HeadSliceLayout, head_slice_descriptors

FIELDS = ("page_lens", "token_lens", "head_offsets")


def expected_layer(layout_args: dict, layer: int, src_pages, dst_pages):
    """(srcs, dsts, lens) of one layer, token by token in Python ints (sglang's formula)."""

    def value(name: str) -> int:
        given = layout_args[name]
        return given if isinstance(given, int) else given[layer]

    columns = {"src": [], "dst": []}
    for side, pages in (("src", src_pages), ("dst", dst_pages)):
        for page in pages:
            for slot in range(layout_args["page_size"]):
                columns[side].append(
                    value(f"{side}_ptrs")
                    + int(page) * value(f"{side}_page_lens")
                    + slot * value(f"{side}_token_lens")
                    + value(f"{side}_head_offsets")
                )
    lens = [value("slice_lens")] * len(columns["src"])
    return columns["src"], columns["dst"], lens


def per_layer(values: st.SearchStrategy[int], num_layers: int) -> st.SearchStrategy:
    """One value for every layer, or a list of one per layer."""
    return values | st.lists(values, min_size=num_layers, max_size=num_layers)


@st.composite
def layouts(draw, magnitude: int = 2**20) -> dict:
    num_layers = draw(st.integers(1, 5))
    small = st.integers(0, magnitude)
    args = {"page_size": draw(st.integers(1, 64)), "slice_lens": draw(per_layer(small, num_layers))}
    for side in ("src", "dst"):
        args[f"{side}_ptrs"] = draw(
            st.lists(st.integers(0, 2**48), min_size=num_layers, max_size=num_layers)
        )
        for field in FIELDS:
            args[f"{side}_{field}"] = draw(per_layer(small, num_layers))
    return args


@given(args=layouts(), data=st.data())
def test_descriptors_match_per_token_arithmetic(args, data):
    num_pages = data.draw(st.integers(0, 6))
    pages = st.lists(st.integers(0, 5000), min_size=num_pages, max_size=num_pages)
    dtype = data.draw(st.sampled_from([np.int32, np.int64]))
    src_pages, dst_pages = (np.array(data.draw(pages), dtype=dtype) for _ in range(2))
    descriptors = head_slice_descriptors(HeadSliceLayout.build(**args), src_pages, dst_pages)
    assert descriptors.num_tokens == num_pages * args["page_size"]
    for layer in range(len(args["src_ptrs"])):
        srcs, dsts, lens = descriptors.layer(layer)
        for column in (srcs, dsts, lens):
            assert column.dtype == np.int64 and column.flags.c_contiguous
        actual = (srcs.tolist(), dsts.tolist(), lens.tolist())
        assert actual == expected_layer(args, layer, src_pages, dst_pages)


def one_layer(**overrides) -> dict:
    args = dict(
        src_ptrs=[0],
        dst_ptrs=[0],
        page_size=4,
        src_page_lens=64,
        dst_page_lens=32,
        src_token_lens=16,
        dst_token_lens=8,
        src_head_offsets=8,
        dst_head_offsets=0,
        slice_lens=8,
    )
    return args | overrides


@pytest.mark.parametrize("side", ["src", "dst"])
def test_a_descriptor_ending_at_int64_max_fits_and_one_byte_more_is_refused(side):
    pages = np.array([0, 3, 1])
    # The last slot of page 3: 3 * page_len + 3 * token_len + offset + len.
    last = {"src": 3 * 64 + 3 * 16 + 8 + 8, "dst": 3 * 32 + 3 * 8 + 0 + 8}[side]
    ptr = INT64_MAX - last
    descriptors = head_slice_descriptors(
        HeadSliceLayout.build(**one_layer(**{f"{side}_ptrs": [ptr]})), pages, pages
    )
    column = descriptors.layer(0)[0 if side == "src" else 1]
    assert int(column[7]) + 8 == INT64_MAX
    layout = HeadSliceLayout.build(**one_layer(**{f"{side}_ptrs": [ptr + 1]}))
    with pytest.raises(gp.PlanValidationError) as error:
        head_slice_descriptors(layout, pages, pages)
    assert str(error.value) == (
        f"layer 0, token 7 (page 3 at {side}_pages[1], slot 3): the {side} descriptor "
        "would end past 2**63 - 1"
    )


@given(
    layer_ptr=st.integers(0, INT64_MAX),
    page_len=st.integers(0, INT64_MAX),
    page=st.integers(0, 2**31 - 1),
)
def test_overflow_is_refused_exactly_where_python_ints_pass_int64(layer_ptr, page_len, page):
    """Values near 2**63 in every term: refused iff some token's exact end passes 2**63 - 1."""
    args = one_layer(src_ptrs=[0, layer_ptr], dst_ptrs=[0, 0], src_page_lens=[64, page_len])
    pages = np.array([page])
    ends = [layer_ptr + page * page_len + s * 16 + 8 + 8 for s in range(4)]
    layout = HeadSliceLayout.build(**args)
    if max(ends) <= INT64_MAX:
        assert head_slice_descriptors(layout, pages, pages).layer(1)[0].tolist() == [
            end - 8 for end in ends
        ]
        return
    first_bad = next(s for s, end in enumerate(ends) if end > INT64_MAX)
    with pytest.raises(gp.PlanValidationError, match=f"^layer 1, token {first_bad} "):
        head_slice_descriptors(layout, pages, pages)


def test_the_first_bad_descriptor_is_named_in_send_order():
    """Layer 0 overflows only on its destination side at token 2; layer 1 on both sides earlier."""
    args = one_layer(src_ptrs=[0, INT64_MAX], dst_ptrs=[INT64_MAX - 100, INT64_MAX], page_size=2)
    with pytest.raises(gp.PlanValidationError, match="^layer 0, token 2 .* the dst descriptor"):
        head_slice_descriptors(HeadSliceLayout.build(**args), np.array([0, 0]), np.array([0, 9]))


@pytest.mark.parametrize(
    ("overrides", "src_pages", "dst_pages", "message"),
    [
        (
            {},
            np.array([1, -2]),
            np.array([0, 0]),
            r"src_pages\[1\] = -2: page indices must be >= 0",
        ),
        ({}, np.array([1, 2]), np.array([0]), "dst_pages: has 1 pages but src_pages has 2"),
        ({}, np.array([1.0]), np.array([0]), "src_pages: expected an integer array"),
        ({"page_size": 0}, np.array([0]), np.array([0]), "page_size: must be an integer >= 1"),
        ({"src_ptrs": [2**63]}, np.array([0]), np.array([0]), r"src_ptrs\[0\] = 2\*\*63|in \[0"),
        ({"slice_lens": -1}, np.array([0]), np.array([0]), r"slice_lens\[0\] = -1"),
        ({"dst_head_offsets": [1, 2]}, np.array([0]), np.array([0]), "dst_head_offsets: has 2"),
        ({"dst_token_lens": 1.5}, np.array([0]), np.array([0]), "dst_token_lens"),
        ({"src_page_lens": [True]}, np.array([0]), np.array([0]), "must be an integer"),
    ],
)
def test_bad_arguments_are_refused_by_name(overrides, src_pages, dst_pages, message):
    with pytest.raises(gp.PlanValidationError, match=message):
        head_slice_descriptors(
            HeadSliceLayout.build(**one_layer(**overrides)), src_pages, dst_pages
        )


def test_layers_of_one_length_share_one_read_only_lengths_column():
    args = one_layer(src_ptrs=[0, 0, 0], dst_ptrs=[0, 0, 0], slice_lens=[8, 4, 8])
    descriptors = head_slice_descriptors(HeadSliceLayout.build(**args), np.arange(3), np.arange(3))
    assert descriptors.layer(0)[2] is descriptors.layer(2)[2]
    assert descriptors.layer(1)[2].tolist() == [4] * 12
    assert not descriptors.layer(0)[2].flags.writeable


def test_docstring_examples():
    results = doctest.testmod(head_slices, extraglobs={"np": np})
    assert results.attempted > 0 and results.failed == 0


def _per_layer_one_by_one(values, num_layers):
    """per_layer's semantics, value by value: the array, or the error's message."""
    if head_slices.is_integer(values):
        values = [values] * num_layers
    listed = list(values)
    if len(listed) != num_layers:
        return f"x: has {len(listed)} values for {num_layers} layers"
    for layer, value in enumerate(listed):
        if not head_slices.is_integer(value):
            return f"x[{layer}] = {value!r}: must be an integer"
        if not 0 <= int(value) <= INT64_MAX:
            return f"x[{layer}]"
    return np.array([int(value) for value in listed], dtype=np.int64)


_ANY_VALUE = st.one_of(
    st.integers(0, INT64_MAX),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, INT64_MAX, INT64_MAX + 1, 2**64 - 1, 2**64, -1, True, False]),
    st.integers(0, 2**31 - 1).map(np.int32),
    st.integers(0, INT64_MAX).map(np.uint64),
    st.floats(0, 8),
)


@given(
    values=st.lists(_ANY_VALUE, max_size=6) | st.integers(-2, INT64_MAX + 2),
    num_layers=st.integers(0, 6),
    form=st.sampled_from(["list", "tuple", "array"]),
)
def test_per_layer_takes_and_refuses_what_a_value_by_value_check_does(values, num_layers, form):
    if not isinstance(values, int):
        if form == "tuple":
            values = tuple(values)
        elif form == "array":
            with contextlib.suppress(OverflowError):  # Python ints past NumPy's stay a list
                values = np.array(values)
    expected = _per_layer_one_by_one(values, num_layers)
    if isinstance(expected, str):
        with pytest.raises(gp.PlanValidationError) as refused:
            head_slices.per_layer(values, "x", num_layers)
        assert str(refused.value).startswith(expected)
    else:
        got = head_slices.per_layer(values, "x", num_layers)
        assert got.dtype == np.int64 and got.tolist() == expected.tolist()
        if isinstance(values, np.ndarray):
            assert not np.shares_memory(got, values)  # the caller's array is never the layout's

"""Different page sizes, without engines: chunk planning, the wire, and the decode's admission.

`unit_send` plus the planner, chunk by chunk as sglang's transfer worker cuts
a request (by prefill pages), must move each sent token from its prefill slot
to its decode slot (an independent token walk) with one descriptor per joint
run per buffer; the frames parse back and refuse what is malformed; the
decode admits a rank's Success only for a declaration that covers every
sent token once, for its own page size.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from sglang_plugin_support import conn  # noqa: F401  (sglang imported first, plugins loaded)

import gpu_planner as gp
from gpu_planner.integration.sglang.frames import FrameError
from gpu_planner.integration.sglang.page_size_wire import (
    PAGE_SIZE_TAG,
    PLANNED_TAG,
    REPAGED_TAG,
    Planned,
    declared_plan,
    page_size_frames,
    planned_frames,
    registered_page_size,
    repaged_frames,
    repaged_request,
)
from gpu_planner.integration.sglang.page_sizes import (
    DecodePageSizes,
    RepagedRoute,
    unit_send,
    virtual_pages,
)

PAGE_SIZES = st.sampled_from([1, 2, 3, 16, 24, 32, 48, 64])
KV_POLL_SUCCESS, KV_POLL_FAILED = 4, 0


def token_slots(pages: np.ndarray, page_size: int, tokens: np.ndarray) -> np.ndarray:
    """The token walk: sent token t at slot pages[t // P] * P + t % P."""
    return pages[tokens // page_size].astype(np.int64) * page_size + tokens % page_size


def moved_tokens(plan: gp.TransferPlan, token_bytes: int) -> list[tuple[int, int]]:
    """(src slot, dst slot) of every token the plan's descriptors move, buffer 0 only."""
    srcs, dsts, lens = plan.columns_array()[:, : plan.num_descriptors]
    pairs = []
    for src, dst, length in zip(srcs.tolist(), dsts.tolist(), lens.tolist(), strict=True):
        if src >= SECOND * token_bytes:  # the second buffer's descriptor
            continue
        for k in range(length // token_bytes):
            pairs.append((src // token_bytes + k, (dst - BASE_DST) // token_bytes + k))
    return pairs


BASE_DST = 1 << 46  # destination addresses near 2**47: int64 all the way
SECOND = 1 << 20  # the second buffer's offset on both sides


@st.composite
def repaged_requests(draw):
    prefill_page_size, decode_page_size = draw(PAGE_SIZES), draw(PAGE_SIZES)
    num_tokens = draw(st.integers(1, 400))
    # The decode's cached prefix, whole pages of its own: the prefill starts at its page below.
    held = draw(st.integers(0, 5)) * decode_page_size % prefill_page_size
    src_count = -(-(held + num_tokens) // prefill_page_size)
    dst_count = -(-num_tokens // decode_page_size)
    layout = draw(st.sampled_from(["fragmented", "contiguous", "shuffled"]))

    def pages(count: int) -> np.ndarray:
        if layout == "contiguous":
            return np.arange(5, 5 + count, dtype=np.int64)
        if layout == "shuffled":
            return np.random.default_rng(count).permutation(count + 7)[:count].astype(np.int64)
        return np.array(draw(st.permutations(range(count + 3)))[:count], dtype=np.int64)

    cuts = sorted(set(draw(st.lists(st.integers(1, max(src_count - 1, 1)), max_size=4))))
    cuts = [0] + [c for c in cuts if 0 < c < src_count] + [src_count]
    return prefill_page_size, decode_page_size, held, pages(src_count), pages(dst_count), cuts


def route_for(
    decode_pages: np.ndarray,
    decode_page_size: int,
    prefix: int = 0,
    held: int = 0,
    device_pages: np.ndarray | None = None,
) -> RepagedRoute:
    return RepagedRoute(1, "decode", decode_page_size, decode_pages, device_pages, prefix, held)


@given(request=repaged_requests(), max_batch_pages=st.sampled_from([0, 1, 3]))
@example(request=(64, 16, 0, np.array([3]), np.array([9, 2, 7, 8]), [0, 1]), max_batch_pages=0)
@example(request=(16, 1, 0, np.arange(2), np.arange(20, 0, -1), [0, 1, 2]), max_batch_pages=0)
@example(request=(48, 32, 0, np.array([0, 2]), np.array([1, 0, 4]), [0, 1, 2]), max_batch_pages=1)
@example(request=(64, 16, 48, np.array([5, 2]), np.array([9, 3]), [0, 1, 2]), max_batch_pages=0)
@example(request=(64, 1, 63, np.array([5, 2]), np.arange(9, 0, -1), [0, 1, 2]), max_batch_pages=0)
def test_chunks_move_every_sent_token_to_its_decode_slot_in_joint_runs(request, max_batch_pages):
    """Each chunk as sglang cuts it (by prefill pages, from the page holding the decode's prefix
    end), planned on its unit pages: together they move exactly the token walk's pairs, from the
    first token the decode does not hold up to the prefill's or the decode's last page, with one
    descriptor per joint run per buffer (per batch)."""
    prefill_page_size, decode_page_size, held, src_pages, dst_pages, cuts = request
    device_pages = dst_pages[::-1].copy()  # HiSparse's other space: other pages, same tokens
    route = route_for(dst_pages, decode_page_size, held=held, device_pages=device_pages)
    token_bytes = 8
    moved: list[tuple[int, int]] = []
    descriptors = runs = 0
    covered = []
    for first, end in zip(cuts[:-1], cuts[1:], strict=True):
        chunk = unit_send(route, first, src_pages[first:end], prefill_page_size)
        unit_len = token_bytes * chunk.unit
        layout = gp.BufferLayout(
            [0, SECOND * token_bytes], [BASE_DST, BASE_DST + SECOND * token_bytes], [unit_len] * 2
        )
        plan = gp.plan_transfer(
            chunk.src_pages, chunk.dst_pages, layout, max_batch_pages=max_batch_pages
        )
        moved += moved_tokens(plan, token_bytes)
        descriptors += plan.num_descriptors
        tokens = np.arange(chunk.first, chunk.end)
        src_tokens = held + tokens - first * prefill_page_size
        src = token_slots(src_pages[first:end], prefill_page_size, src_tokens)
        dst = token_slots(dst_pages, decode_page_size, tokens)
        device_slots = token_slots(device_pages, decode_page_size, tokens)
        assert (token_slots(chunk.dst_device_pages, chunk.unit, tokens - chunk.first)
                == device_slots).all()  # fmt: skip
        breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
        if max_batch_pages:
            unit_index = (tokens - chunk.first) // chunk.unit
            breaks |= np.diff(unit_index // max_batch_pages) != 0
        runs += 1 + int(np.count_nonzero(breaks))
        covered.append((chunk.first, chunk.end))
    sent = min(len(src_pages) * prefill_page_size - held, len(dst_pages) * decode_page_size)
    tokens = np.arange(sent)
    chunk_of = np.searchsorted(np.array(cuts) * prefill_page_size, held + tokens, "right") - 1
    src_expected = token_slots(src_pages, prefill_page_size, held + tokens)
    dst_expected = token_slots(dst_pages, decode_page_size, tokens)
    assert covered[0][0] == 0 and covered[-1][1] == sent
    assert all(a[1] == b[0] for a, b in zip(covered[:-1], covered[1:], strict=True))
    assert sorted(moved) == sorted(zip(src_expected.tolist(), dst_expected.tolist(), strict=True))
    assert chunk_of.min() >= 0
    assert descriptors == 2 * runs


def test_a_chunk_past_the_decodes_pages_or_an_unaligned_prefix_is_refused():
    route = route_for(np.arange(2), 16)
    with pytest.raises(gp.PlanValidationError, match="past the decode's 2 pages"):
        unit_send(route, 1, np.arange(1), 64)
    with pytest.raises(gp.PlanValidationError, match="prefix of 48 tokens and 0 held"):
        unit_send(route_for(np.arange(4), 16, prefix=48), 0, np.arange(1), 64)
    with pytest.raises(gp.PlanValidationError, match="prefix of 0 tokens and 64 held"):
        unit_send(route_for(np.arange(4), 16, held=64), 0, np.arange(2), 64)
    with pytest.raises(gp.PlanValidationError, match="prefill_data_indices\\[0\\] = -1"):
        unit_send(route, 0, np.array([-1]), 16)


def test_virtual_pages_lie_past_any_registered_buffer():
    pages = virtual_pages(5)
    assert pages.dtype == np.int32 and pages.tolist() == list(range(2**31 - 5, 2**31))


def test_the_frames_parse_back():
    registration = [b"frame"] * 20 + page_size_frames(16)
    assert registered_page_size(registration) == 16
    assert registered_page_size([b"frame"] * 20) is None
    metadata = [b"frame"] * 10 + repaged_frames(np.array([3, 1, 2]), 48)
    repaged = repaged_request(metadata)
    np.testing.assert_array_equal(repaged.pages, [3, 1, 2])
    assert repaged.held == 48 and repaged.device_pages is None
    metadata = [b"frame"] * 10 + repaged_frames(np.array([3, 1]), 0, np.array([7, 8]))
    np.testing.assert_array_equal(repaged_request(metadata).device_pages, [7, 8])
    assert repaged_request([b"frame"] * 10) is None
    plans = {"a:1": Planned(16, ((0, 64), (64, 100))), "b:2": Planned(1, ())}
    status = [b"7", b"4", b"0", b""] + planned_frames(plans)
    assert declared_plan(status, "a:1") == plans["a:1"]
    assert declared_plan(status, "b:2") == plans["b:2"]
    assert declared_plan(status, "c:3") is None
    assert declared_plan([b"7", b"4", b"0", b""], "a:1") is None


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([b"f"] * 20 + [PAGE_SIZE_TAG, b"\x00" * 8], "page size 0"),
        ([b"f"] * 20 + [PAGE_SIZE_TAG, b"\x01"], "1 bytes, expected 8"),
        ([b"f"] * 20 + [PAGE_SIZE_TAG], "followed by its frame"),
        ([b"f"] * 20 + page_size_frames(16) + page_size_frames(16), "appear once"),
    ],
)
def test_a_malformed_page_size_is_refused_naming_it(frames, message):
    with pytest.raises(FrameError, match=message):
        registered_page_size(frames)


def test_malformed_pages_and_declarations_are_refused_naming_them():
    pages = np.array([1, -3], np.int32).tobytes()
    two = np.array([1, 2], np.int32).tobytes()
    for frames, message in [
        ([REPAGED_TAG, pages, b"\x00" * 8, b""], "repaged pages\\[1\\] = -3"),
        ([REPAGED_TAG, pages, b"\x00" * 8], "followed by its pages, held tokens and device"),
        ([REPAGED_TAG, b"", b"\x00" * 4, b""], "4 bytes, expected 8"),
        ([REPAGED_TAG, b"", b"\xff" * 8, b""], "not below"),
        ([REPAGED_TAG, two, b"\x00" * 8, two[:4]], "1 device pages for 2 pages"),
        ([REPAGED_TAG, two, b"\x00" * 8, pages], "device pages\\[1\\] = -3"),
    ]:
        with pytest.raises(FrameError, match=message):
            repaged_request([b"f"] * 10 + frames)
    with pytest.raises(ValueError, match="page ids must fit int32"):
        repaged_frames(np.array([2**31]), 0)
    head = [b"7", b"4", b"0", b""]
    bad = [
        ([PLANNED_TAG], "followed by its sessions"),
        ([PLANNED_TAG, b"a:1"], "without a frame each"),
        ([PLANNED_TAG, b"a:1", b"\x00" * 8], "not a header"),
        ([PLANNED_TAG, b"a:1", Planned(16, ((5, 5),)).frame()], "or empty"),
        ([PLANNED_TAG, b"a:1", Planned(16, ((0, 2**41),)).frame()], "past 2\\*\\*40"),
        ([PLANNED_TAG, b"a:1\na:1", *[Planned(1, ()).frame()] * 2], "declared twice"),
    ]
    for frames, message in bad:
        with pytest.raises(FrameError, match=message):
            declared_plan(head + frames, "a:1")


class Manager:
    """What `DecodePageSizes` reads of a decode manager."""

    def __init__(self, page_size: int) -> None:
        self.kv_args = type("KVArgs", (), {"page_size": page_size})()

    def get_session_id(self) -> str:
        return "decode:1"


@pytest.mark.parametrize(
    ("declared", "reason"),
    [
        (None, "declares no plan"),
        ("bad frame", "does not parse"),
        (Planned(64, ((0, 48),)), "planned for page size 64"),
        (Planned(16, ((16, 48),)), "up to 0, then from 16"),
        (Planned(16, ((0, 16), (32, 48))), "up to 16, then from 32"),
        (Planned(16, ((0, 32),)), "end at token 32, not in the last page"),
        (Planned(16, ((0, 64),)), "end at token 64, not in the last page"),
    ],
)
def test_a_success_whose_declaration_misses_a_token_is_failed(declared, reason):
    decode = DecodePageSizes(Manager(16))
    decode.sent(9, 64, 3)  # three decode pages: sent tokens end in (32, 48]
    decode.on_declared(9, 0, declared)
    refusal = decode.refusal(9, KV_POLL_SUCCESS, 0, 1)
    assert refusal is not None and reason in refusal and "page size 16" in refusal


def test_a_success_covering_every_sent_token_is_admitted_and_the_room_forgotten():
    decode = DecodePageSizes(Manager(16))
    decode.sent(9, 64, 3)
    decode.on_declared(9, 0, Planned(16, ((0, 16), (16, 40))))
    assert decode.refusal(9, KV_POLL_SUCCESS, 0, 1) is None
    decode.after_status({9: KV_POLL_SUCCESS}, 9)
    decode.on_declared(9, 0, None)  # a later request of the room, sent to an equal prefill
    assert decode.refusal(9, KV_POLL_SUCCESS, 0, 1) is None


def test_ranks_that_sent_no_kv_pass_but_not_all_of_them():
    """A rank that sent this decode no KV declares no range; if every rank says so, the KV
    never came."""
    decode = DecodePageSizes(Manager(16))
    decode.sent(9, 64, 3)
    decode.on_declared(9, 0, Planned(16, ()))
    assert decode.refusal(9, KV_POLL_SUCCESS, 0, 2) is None
    decode.on_declared(9, 1, Planned(16, ()))
    assert "every prefill rank declared" in decode.refusal(9, KV_POLL_SUCCESS, 1, 2)
    decode.sent(10, 64, 3)
    decode.on_declared(10, 0, Planned(16, ()))
    assert decode.refusal(10, KV_POLL_SUCCESS, 0, 2) is None
    decode.on_declared(10, 1, Planned(16, ((0, 48),)))
    assert decode.refusal(10, KV_POLL_SUCCESS, 1, 2) is None


def test_a_failed_status_or_an_equal_room_is_not_judged():
    decode = DecodePageSizes(Manager(16))
    decode.sent(9, 64, 3)
    decode.on_declared(9, 0, None)
    assert decode.refusal(9, KV_POLL_FAILED, 0, 1) is None
    assert decode.refusal(10, KV_POLL_SUCCESS, 0, 1) is None

"""A prefill and a decode of different page sizes, through two real Mooncake engines.

The prefill is a real `MooncakeKVManager` sending with sglang's
`MooncakeTransferEngine` over TCP on 127.0.0.1; the decode is a real one with a
registered KV pool. Everything between them goes as sglang moves it, through
the hooked code: the decode's fetch of the prefill's info (sglang's own
`try_ensure_parallel_info`, its HTTP answer stubbed), its registration and each
request's metadata (sent from `send_metadata`), the prefill's parsers, the
generic send of each chunk as sglang's transfer worker cuts it (by prefill
pages), and the prefill's status through the decode's handler. The decode's
pool must hold, for every sent token, the prefill's bytes of that token
(`expected_pool`: a token walk), and nothing else.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import threading
import time
import types

import numpy as np
import pytest
from sglang.srt import runtime_context
from sglang.srt.disaggregation.common import conn as common_conn
from sglang_plugin_support import (
    KVPool,
    conn,
    deliver_status,
    hooked_metadata,
    hooked_send,
    make_decode_manager,
    registration_frames,
)
from sglang_plugin_support import make_manager as make_prefill_manager
from suite_support import set_knob

from bench.page_sizes import route_answer
from gpu_planner import settings
from gpu_planner.integration.sglang import (
    counters,
    page_sizes,
    prefill_routes,
    receive_staging,
    send_slots,
)
from gpu_planner.integration.sglang.page_size_wire import PLANNED_TAG, REPAGED_TAG
from gpu_planner.integration.sglang.staging_wire import STAGED_TAG
from gpu_planner.kernels import interpreter_enabled

POOL_TOKENS = 1024  # each side's pool, in tokens
TOKEN_BYTES = [8, 8, 4, 4]  # K and V of two layers, bytes per token (unequal: caught per buffer)
KV_POLL_TRANSFERRING, KV_POLL_SUCCESS, KV_POLL_FAILED = 3, 4, 0
BOOTSTRAP = "127.0.0.1:8998"
ORIGINAL_TRANSFER_INFO = inspect.unwrap(conn.TransferInfo.from_zmq.__func__)
ORIGINAL_STATUS = inspect.unwrap(conn.MooncakeKVManager._encode_kv_status_message)


class Pair:
    """A prefill of `prefill_page_size` and a decode of `decode_page_size`, connected."""

    def __init__(
        self,
        engines,
        monkeypatch,
        prefill_page_size: int,
        decode_page_size: int,
        mla=False,
        token_bytes: tuple[list[int], list[int]] = (TOKEN_BYTES, TOKEN_BYTES),
        place=None,
        device_buffers: int = 0,
        built=None,
    ):
        """`built`: called with the decode's manager, then the prefill's, before the decode
        registers (as sglang's AFTER hooks on a manager's `__init__` run)."""
        prefill_engine, decode_engine = engines
        self.prefill_page_size, self.decode_page_size = prefill_page_size, decode_page_size
        self.token_bytes = token_bytes  # (prefill, decode) bytes per token of each buffer
        self.source = KVPool(
            prefill_engine,
            [n * prefill_page_size for n in token_bytes[0]],
            "random",
            prefill_page_size,
            pages=POOL_TOKENS // prefill_page_size,
        )
        self.destination = KVPool(
            decode_engine,
            [n * decode_page_size for n in token_bytes[1]],
            "zeros",
            pages=POOL_TOKENS // decode_page_size,
        )
        if place is not None:  # both pools stand for a GPU's (`host_cuda`)
            place(self.source.tensor, 0)
            place(self.destination.tensor, 0)
        self.decode = make_decode_manager(
            decode_engine,
            self.destination.ptrs,
            self.destination.lens,
            self.destination.item_lens,
            decode_page_size,
            num_draft_entries=device_buffers,  # HiSparse: the last ones take device pages
        )
        self.device_ptrs = set(self.destination.ptrs[len(self.destination.ptrs) - device_buffers :])
        self.prefill = make_prefill_manager(
            prefill_engine, mla=mla, kv_data_ptrs=self.source.ptrs, kv_data_lens=self.source.lens
        )
        self.prefill.kv_args.page_size = prefill_page_size
        self.prefill.kv_args.kv_item_lens = self.source.item_lens
        self.session = decode_engine.session_id
        self.notes: list[list[bytes]] = []
        self.prefill.decode_kv_args_table = {}
        page_sizes.manager_built_hook(None, _as_prefill(self.prefill))
        if built is not None:
            built(self.decode)
            built(self.prefill)
        decode = self.decode  # what sglang's fetch of the prefill's info reads
        decode.prefill_info_table, decode.kv_cache_dtype_str = {}, "auto"
        decode.kv_args.state_types = []
        decode.attn_tp_size, decode.dcp_size = 1, 1
        decode.kv_layout = decode.dsv41_spec_layout = None
        decode.is_mla_backend = decode.is_hybrid_mla_backend = False
        decode._resolve_rank_mapping = lambda info: None
        assert self.connect(monkeypatch)
        self.register()

    def connect(self, monkeypatch) -> bool:
        """sglang's own fetch of the prefill's info (hooked), its HTTP answer stubbed."""
        self.decode.prefill_info_table.clear()
        answer = types.SimpleNamespace(
            status_code=200, json=lambda: route_answer(self.prefill_page_size)
        )
        monkeypatch.setattr(common_conn.requests, "get", lambda url, timeout: answer)
        return conn.MooncakeKVManager.try_ensure_parallel_info(self.decode, BOOTSTRAP)

    def register(self) -> None:
        frames = registration_frames(self.destination, self.session)
        sent = receive_staging.registration_message_hook(lambda _: frames, self.decode)
        self.prefill.decode_kv_args_table[self.session] = conn.KVArgsRegisterInfo.from_zmq(sent)

    def metadata(
        self, room: int, decode_pages: np.ndarray, prefix: int = 0, device_pages=None
    ) -> list[bytes]:
        """The decode's metadata for `room`, built inside sglang's `send_metadata` (hooked)."""
        self.decode.request_status[room] = KV_POLL_TRANSFERRING
        self.decode.prefill_response_tracker[room] = set()
        self.decode.required_prefill_response_num_table[room] = 1

        def send_metadata(receiver) -> list[bytes]:
            return hooked_metadata(
                self.decode, room, self.session, decode_pages, device_pages, prefix=prefix
            )

        receiver = types.SimpleNamespace(bootstrap_addr=BOOTSTRAP)
        return page_sizes.send_metadata_hook(send_metadata, receiver)

    def parse(self, room: int, frames: list[bytes], parser=None):
        """The prefill's parse of the metadata (the hooked parser, or `parser`)."""
        info = parser(conn.TransferInfo, frames) if parser else conn.TransferInfo.from_zmq(frames)
        self.prefill.transfer_infos[room] = {self.session: info}
        return info

    def keep_notes(self, prefill) -> None:
        """Keep what `prefill` sends the decode on sglang's status socket (staged notes)."""
        prefill._send_multipart_locked = lambda _, parts, is_ipv6=False: self.notes.append(parts)

    def deliver_notes(self) -> int:
        """The kept notes through the decode's hooked chunk handler; how many there were."""
        notes, self.notes = self.notes, []
        for note in notes:
            assert note[0] == STAGED_TAG
            assert conn.MooncakeKVManager.handle_chunk_ready(self.decode, note)
        return len(notes)

    def send_chunks(self, info, src_pages: np.ndarray, cuts: list[int], executor=None) -> list[int]:
        """Each chunk as sglang's transfer worker sends it: the decode's pages cut by the
        chunk's prefill pages (`req.dst_kv_indices[kv_chunk.index_slice]`), truncated as it
        truncates; no call where the chunk's destination is empty."""
        statuses = []
        device = info.dst_device_kv_indices
        for first, end in zip(cuts[:-1], cuts[1:], strict=True):
            dst = info.dst_kv_indices[first:end]
            src = src_pages[first:end][: len(dst)]
            if len(src) == 0:
                continue
            statuses.append(
                hooked_send()(
                    self.prefill,
                    mooncake_session_id=self.session,
                    src_data_ptrs=self.source.ptrs,
                    dst_data_ptrs=self.destination.ptrs,
                    item_lens=self.source.item_lens,
                    prefill_data_indices=src,
                    dst_data_indices=dst,
                    executor=executor,
                    dst_device_data_indices=None if device is None else device[first:end],
                    dst_device_data_ptrs=self.device_ptrs or None,
                )
            )
        return statuses

    def sent_tokens(self, src_pages: np.ndarray, dst_pages: np.ndarray, held: int) -> int:
        """Tokens sent: the prefill's pages past the `held` the decode holds, up to its last."""
        prefill_tokens = len(src_pages) * self.prefill_page_size - held
        return min(prefill_tokens, len(dst_pages) * self.decode_page_size)

    def expected_pool(
        self,
        src_pages: np.ndarray,
        dst_pages: np.ndarray,
        heads=None,
        expected=None,
        held=0,
        device_pages=None,
    ) -> np.ndarray:
        """The decode's pool after every sent token's bytes landed in its slot: the tokens of
        the prefill's pages past the first `held`, up to the decode's last page (a token walk);
        `heads` (source offset, destination offset, bytes) of each token's head slice, else
        whole tokens; HiSparse's device-backed buffers at `device_pages`."""
        if expected is None:
            expected = np.zeros_like(self.destination.tensor.numpy())
        source = self.source.tensor.numpy()
        tokens = np.arange(self.sent_tokens(src_pages, dst_pages, held))
        prefill_tokens = held + tokens
        src_slots = src_pages[prefill_tokens // self.prefill_page_size] * self.prefill_page_size
        src_slots += prefill_tokens % self.prefill_page_size
        for buffer, (src_width, dst_width) in enumerate(zip(*self.token_bytes, strict=True)):
            on_device = self.destination.ptrs[buffer] in self.device_ptrs
            pages = device_pages if on_device else dst_pages
            dst_slots = pages[tokens // self.decode_page_size] * self.decode_page_size
            dst_slots += tokens % self.decode_page_size
            src_offset, dst_offset, width = heads or (0, 0, src_width)
            src_base = self.source.offsets[buffer] + src_offset
            dst_base = self.destination.offsets[buffer] + dst_offset
            byte = np.arange(width)
            src_bytes = src_base + (src_slots[:, None] * src_width + byte).reshape(-1)
            dst_bytes = dst_base + (dst_slots[:, None] * dst_width + byte).reshape(-1)
            expected[dst_bytes] = source[src_bytes]
        return expected

    def joint_runs(
        self, src_pages: np.ndarray, dst_pages: np.ndarray, cuts: list[int], held: int = 0
    ) -> int:
        """Maximal runs of tokens whose slots step by one on both sides, within each chunk."""
        sent = self.sent_tokens(src_pages, dst_pages, held)
        runs = 0
        for first, end in zip(cuts[:-1], cuts[1:], strict=True):
            prefill_tokens = np.arange(
                max(first * self.prefill_page_size, held),
                min(end * self.prefill_page_size, held + sent),
            )
            if prefill_tokens.size == 0:
                continue
            tokens = prefill_tokens - held
            src = src_pages[prefill_tokens // self.prefill_page_size] * self.prefill_page_size
            src += prefill_tokens % self.prefill_page_size
            dst = dst_pages[tokens // self.decode_page_size] * self.decode_page_size
            dst += tokens % self.decode_page_size
            runs += 1 + int(np.count_nonzero((np.diff(src) != 1) | (np.diff(dst) != 1)))
        return runs

    def close(self) -> None:
        receive_staging.REGIONS.release(self.decode)
        send_slots.SEND_SLOTS.release(self.prefill)
        for pool in (self.source, self.destination):
            pool.close()
        page_sizes.DECODES.release(self.decode)


def _as_prefill(manager):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    manager.disaggregation_mode = DisaggregationMode.PREFILL
    return manager


@pytest.fixture
def pairs(engines, monkeypatch):
    """Pairs made by `make`; their decode lends no receive staging (`staged_pairs` does)."""
    set_knob(monkeypatch, settings.GATHER_STAGING_BYTES.name, str(4 << 20))  # 1 MiB slots
    set_knob(monkeypatch, settings.RECEIVE_STAGING_BYTES.name, "0")
    settings.load()
    made: list[Pair] = []

    def make(
        prefill_page_size: int,
        decode_page_size: int,
        mla=False,
        token_bytes=None,
        place=None,
        device_buffers=0,
    ) -> Pair:
        widths = token_bytes or (TOKEN_BYTES, TOKEN_BYTES)
        made.append(
            Pair(
                engines,
                monkeypatch,
                prefill_page_size,
                decode_page_size,
                mla,
                widths,
                place,
                device_buffers,
            )  # fmt: skip
        )
        return made[-1]

    yield make
    for pair in made:
        pair.close()
    page_sizes.PREFILL.forget()
    prefill_routes.ROUTES.forget()


@pytest.fixture
def staged_pairs(pairs, monkeypatch):
    """`pairs` whose decode lends receive staging, and whose prefill stages a send of eight
    descriptors or more."""
    set_knob(monkeypatch, settings.RECEIVE_STAGING_BYTES.name, str(4 << 20))
    set_knob(monkeypatch, settings.STAGING_MIN_DESCRIPTORS.name, "8")
    settings.load()
    return pairs


STAGING_EXECUTOR = concurrent.futures.ThreadPoolExecutor(1)  # sglang's, per transfer queue


def shuffled_pages(rng: np.random.Generator, count: int, page_size: int) -> np.ndarray:
    """`count` distinct pages of a pool of POOL_TOKENS tokens, in runs of one to three."""
    pool_pages = POOL_TOKENS // page_size
    starts = rng.permutation(pool_pages)
    runs = np.concatenate([np.arange(s, s + rng.integers(1, 4)) for s in starts]) % pool_pages
    _, first_seen = np.unique(runs, return_index=True)
    return runs[np.sort(first_seen)][:count].astype(np.int32)


PAIRS = [(64, 16), (16, 64), (16, 1), (1, 16), (32, 64), (64, 32), (64, 1)]


@pytest.mark.parametrize(("prefill_page_size", "decode_page_size"), PAIRS)
@pytest.mark.parametrize("chunks", [1, 3])
def test_every_sent_token_lands_in_its_decode_slot(
    pairs, prefill_page_size, decode_page_size, chunks
):
    """Fragmented pages on both sides, chunked as sglang chunks (by prefill pages): each sent
    token's bytes in its decode slot, one descriptor per joint run per buffer, and the
    decode's Success admitted."""
    pair = pairs(prefill_page_size, decode_page_size)
    rng = np.random.default_rng(prefill_page_size * 100 + decode_page_size + chunks)
    num_tokens = 700 if max(prefill_page_size, decode_page_size) > 1 else 300
    src_pages = shuffled_pages(rng, -(-num_tokens // prefill_page_size), prefill_page_size)
    dst_pages = shuffled_pages(rng, -(-num_tokens // decode_page_size), decode_page_size)
    frames = pair.metadata(11, dst_pages)
    assert REPAGED_TAG in frames and frames[4] == b""  # sglang's page frame: empty
    info = pair.parse(11, frames)
    cuts = sorted({0, len(src_pages), *rng.integers(1, len(src_pages), chunks - 1).tolist()})
    before = counters.snapshot()["descriptors"]
    assert pair.send_chunks(info, src_pages.astype(np.int64), cuts) == [0] * (len(cuts) - 1)
    descriptors = counters.snapshot()["descriptors"] - before
    assert descriptors == len(TOKEN_BYTES) * pair.joint_runs(src_pages, dst_pages, cuts)
    deliver_status(pair.prefill, pair.decode, 11, KV_POLL_SUCCESS)
    assert pair.decode.request_status[11] == KV_POLL_SUCCESS, pair.decode.failure_records
    np.testing.assert_array_equal(
        pair.destination.tensor.numpy(), pair.expected_pool(src_pages, dst_pages)
    )


def test_a_plain_sglang_prefill_writes_nothing_and_its_request_fails_naming_both(pairs):
    """sglang's own parser takes no page from the metadata, so its transfer worker sends no
    KV; the Success it sends declares nothing, and the decode fails the request."""
    pair = pairs(64, 16)
    rng = np.random.default_rng(5)
    src_pages = shuffled_pages(rng, 8, 64)
    frames = pair.metadata(12, shuffled_pages(rng, 32, 16))
    info = pair.parse(12, frames, parser=ORIGINAL_TRANSFER_INFO)
    assert pair.send_chunks(info, src_pages, [0, 8]) == []  # sglang truncates to no page
    frames = ORIGINAL_STATUS(
        pair.prefill, bootstrap_room=12, status=KV_POLL_SUCCESS, failure_reason=None
    )
    assert PLANNED_TAG not in frames
    conn.MooncakeKVManager.apply_prefill_status(
        pair.decode, bootstrap_room=12, status=KV_POLL_SUCCESS, prefill_rank=0, failure_reason=None
    )
    assert pair.decode.request_status[12] == KV_POLL_FAILED
    reason = pair.decode.failure_records[12]
    assert "page size 64" in reason and "page size 16" in reason and "plain sglang" in reason
    assert not pair.destination.tensor.numpy().any()


@pytest.mark.parametrize(
    ("prefill_page_size", "decode_page_size", "prefix"),
    [(64, 16, 48), (64, 16, 80), (64, 1, 127), (32, 16, 16), (16, 64, 64)],
)
def test_a_decode_prefix_inside_a_prefill_page_is_served(
    pairs, prefill_page_size, decode_page_size, prefix
):
    """The decode's radix cache holds whole pages of its own: sglang's prefill, told the prefix
    rounded down to its pages, sends from the page holding the prefix's end, and the send skips
    the tokens the decode holds. Nothing else of the decode's pool changes."""
    pair = pairs(prefill_page_size, decode_page_size)
    rng = np.random.default_rng(prefix)
    held, num_tokens = prefix % prefill_page_size, 300
    src_pages = shuffled_pages(rng, -(-(held + num_tokens) // prefill_page_size), prefill_page_size)
    dst_pages = shuffled_pages(rng, -(-num_tokens // decode_page_size), decode_page_size)
    info = pair.parse(13, pair.metadata(13, dst_pages, prefix=prefix))
    assert info.decode_prefix_len == prefix - held  # what sglang's prefill starts its send at
    cuts = [0, 1, len(src_pages) // 2, len(src_pages)]
    before = counters.snapshot()["descriptors"]
    assert pair.send_chunks(info, src_pages.astype(np.int64), cuts) == [0, 0, 0]
    descriptors = counters.snapshot()["descriptors"] - before
    assert descriptors == len(TOKEN_BYTES) * pair.joint_runs(src_pages, dst_pages, cuts, held)
    deliver_status(pair.prefill, pair.decode, 13, KV_POLL_SUCCESS)
    assert pair.decode.request_status[13] == KV_POLL_SUCCESS, pair.decode.failure_records
    np.testing.assert_array_equal(
        pair.destination.tensor.numpy(), pair.expected_pool(src_pages, dst_pages, held=held)
    )


@pytest.mark.parametrize(
    ("prefill_page_size", "decode_page_size", "prefix"),
    [(64, 16, 0), (16, 64, 0), (64, 16, 48), (16, 1, 32), (32, 64, 64)],
)
def test_a_staged_send_to_another_page_size_lands_every_sent_token(
    staged_pairs, prefill_page_size, decode_page_size, prefix
):
    """A decode with receive staging lends the request a part in the pages the prefill's sends
    take (`gcd` tokens): each chunk is staged there, scattered by the decode into its pages,
    and the pool holds every sent token and nothing else; the part comes back at Success."""
    pair = staged_pairs(prefill_page_size, decode_page_size)
    pair.keep_notes(pair.prefill)
    rng = np.random.default_rng(prefill_page_size * 7 + decode_page_size + prefix)
    held, num_tokens = prefix % prefill_page_size, 600
    src_pages = shuffled_pages(rng, -(-(held + num_tokens) // prefill_page_size), prefill_page_size)
    dst_pages = shuffled_pages(rng, -(-num_tokens // decode_page_size), decode_page_size)
    region = receive_staging.REGIONS.existing(pair.decode)
    info = pair.parse(21, pair.metadata(21, dst_pages, prefix=prefix))
    assert region.lent_rooms == 1
    cuts = [0, 1, len(src_pages) // 2, len(src_pages)]
    before = counters.snapshot()["sends"]
    statuses = pair.send_chunks(info, src_pages.astype(np.int64), cuts, STAGING_EXECUTOR)
    assert statuses == [0, 0, 0]
    staged = counters.snapshot()["sends"].get("staged/arrays", 0) - before.get("staged/arrays", 0)
    assert pair.deliver_notes() == staged > 0, counters.snapshot()["paths_chosen"]
    deliver_status(pair.prefill, pair.decode, 21, KV_POLL_SUCCESS)
    assert pair.decode.request_status[21] == KV_POLL_SUCCESS, pair.decode.failure_records
    np.testing.assert_array_equal(
        pair.destination.tensor.numpy(), pair.expected_pool(src_pages, dst_pages, held=held)
    )
    assert region.lent_rooms == 0


@pytest.mark.skipif(not interpreter_enabled(), reason="the stand-in's kernels need Triton's")
def test_a_gpu_decode_lends_unit_pages_once_their_scatter_compiled_off_the_request_path(
    staged_pairs, host_cuda, monkeypatch
):
    """On a GPU (the CUDA stand-in, its kernels on the Triton interpreter) the scatter of pages
    of another unit is no variant the manager's warm-up compiled: the first request toward such
    a prefill starts its compile on a thread of its own and is lent nothing (counted, sent
    direct), as is every request until it is done; then requests are lent and staged."""
    compiling, compiles = threading.Event(), []
    warm_up = receive_staging.warm_up_slice_copies

    def gated_warm_up(torch_device, copies):
        compiles.append(sorted({copy.page_size for copy in copies}))
        assert compiling.wait(60)
        return warm_up(torch_device, copies)

    monkeypatch.setattr(receive_staging, "warm_up_slice_copies", gated_warm_up)
    pair = staged_pairs(16, 64, place=host_cuda.place)
    pair.keep_notes(pair.prefill)
    region = receive_staging.REGIONS.existing(pair.decode)
    assert region.torch_device.type == "cuda"
    rng = np.random.default_rng(3)
    src_pages, dst_pages = shuffled_pages(rng, 16, 16), shuffled_pages(rng, 4, 64)
    expected = pair.expected_pool(src_pages, dst_pages)
    before = counters.snapshot()
    for room in (31, 32):  # while it compiles: direct
        info = pair.parse(room, pair.metadata(room, dst_pages))
        assert region.lent_rooms == 0
        assert pair.send_chunks(info, src_pages.astype(np.int64), [0, 8, 16]) == [0, 0]
        assert pair.deliver_notes() == 0
        deliver_status(pair.prefill, pair.decode, room, KV_POLL_SUCCESS)
        assert pair.decode.request_status[room] == KV_POLL_SUCCESS
    compiling.set()
    deadline = time.monotonic() + 120
    while region.scatter_unready(16):
        assert time.monotonic() < deadline, "the scatter's compile did not end"
        time.sleep(0.05)
    assert compiles == [[16]]  # once, for pages of gcd(16, 64) tokens
    pair.destination.tensor.zero_()
    info = pair.parse(33, pair.metadata(33, dst_pages))
    assert region.lent_rooms == 1
    assert pair.send_chunks(info, src_pages.astype(np.int64), [0, 8, 16], STAGING_EXECUTOR) == [
        0,
        0,
    ]
    assert pair.deliver_notes() == 2
    deliver_status(pair.prefill, pair.decode, 33, KV_POLL_SUCCESS)
    assert pair.decode.request_status[33] == KV_POLL_SUCCESS, pair.decode.failure_records
    np.testing.assert_array_equal(pair.destination.tensor.numpy(), expected)
    reason, key = receive_staging.SCATTER_COMPILING, "receive_staging_fallbacks"
    assert counters.snapshot()[key][reason] - before[key].get(reason, 0) == 2


@pytest.mark.parametrize(("prefill_page_size", "decode_page_size"), [(64, 16), (16, 64), (16, 1)])
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_hisparse_two_page_spaces_land_every_sent_token_in_its_own_space(
    request, prefill_page_size, decode_page_size, staged
):
    """HiSparse with a draft pool: the decode's last two buffers take the device pages, the
    others the host pages, both in the decode's page size. Each space's pages go in `Repaged`
    and are taken as pages of the unit; every sent token lands in its space's slot, directly
    or staged (the part lent in unit pages of both spaces, scattered by them)."""
    pair = request.getfixturevalue("staged_pairs" if staged else "pairs")(
        prefill_page_size, decode_page_size, device_buffers=2
    )
    pair.keep_notes(pair.prefill)
    rng = np.random.default_rng(prefill_page_size + decode_page_size + staged)
    num_tokens = 500
    src_pages = shuffled_pages(rng, -(-num_tokens // prefill_page_size), prefill_page_size)
    host_pages = shuffled_pages(rng, -(-num_tokens // decode_page_size), decode_page_size)
    device_pages = shuffled_pages(rng, len(host_pages), decode_page_size)
    info = pair.parse(23, pair.metadata(23, host_pages, device_pages=device_pages))
    assert info.dst_device_kv_indices is info.dst_kv_indices  # sglang slices both alike
    cuts = [0, len(src_pages) // 3, len(src_pages)]
    before = counters.snapshot()["sends"].get("staged/arrays", 0)
    assert pair.send_chunks(info, src_pages.astype(np.int64), cuts, STAGING_EXECUTOR) == [0, 0]
    staged_sends = counters.snapshot()["sends"].get("staged/arrays", 0) - before
    assert pair.deliver_notes() == staged_sends == (2 if staged else 0)
    deliver_status(pair.prefill, pair.decode, 23, KV_POLL_SUCCESS)
    assert pair.decode.request_status[23] == KV_POLL_SUCCESS, pair.decode.failure_records
    expected = pair.expected_pool(src_pages, host_pages, device_pages=device_pages)
    np.testing.assert_array_equal(pair.destination.tensor.numpy(), expected)


def test_a_unit_scatter_that_did_not_compile_lends_nothing_and_says_so(
    staged_pairs, host_cuda, monkeypatch
):
    """A failed compile is logged and counted once; its unit's requests go direct, each
    counted under that reason (not as compiling), and are served."""

    def failing_warm_up(torch_device, copies):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(receive_staging, "warm_up_slice_copies", failing_warm_up)
    pair = staged_pairs(16, 64, place=host_cuda.place)
    region = receive_staging.REGIONS.existing(pair.decode)
    assert region.scatter_unready(16) == receive_staging.SCATTER_COMPILING  # starts it
    deadline = time.monotonic() + 60
    while region.scatter_unready(16) == receive_staging.SCATTER_COMPILING:
        assert time.monotonic() < deadline, "the failing compile did not end"
        time.sleep(0.01)
    assert region.scatter_unready(16) == receive_staging.SCATTER_FAILED
    rng = np.random.default_rng(4)
    src_pages, dst_pages = shuffled_pages(rng, 16, 16), shuffled_pages(rng, 4, 64)
    key, reason = "receive_staging_fallbacks", receive_staging.SCATTER_FAILED
    before = counters.snapshot()[key].get(reason, 0)
    info = pair.parse(34, pair.metadata(34, dst_pages))
    assert region.lent_rooms == 0 and counters.snapshot()[key][reason] == before + 1
    assert pair.send_chunks(info, src_pages.astype(np.int64), [0, 16]) == [0]
    deliver_status(pair.prefill, pair.decode, 34, KV_POLL_SUCCESS)
    assert pair.decode.request_status[34] == KV_POLL_SUCCESS, pair.decode.failure_records
    np.testing.assert_array_equal(
        pair.destination.tensor.numpy(), pair.expected_pool(src_pages, dst_pages)
    )


@pytest.mark.parametrize(("prompt", "prefix"), [(80, 80), (64, 64), (90, 80)])
def test_a_prompt_the_decodes_prefix_covers_moves_only_what_it_lacks(pairs, prompt, prefix):
    """The decode's radix cache may hold a whole prompt (80 or 64 tokens: no page to send) or
    all but a few tokens. sglang's prefill, told the prefix rounded down to its pages, still
    sends the page holding its end: a chunk of held tokens moves nothing, and Success counts
    with nothing, or only the tokens the decode lacks, declared. No byte of a held token is
    written."""
    pair = pairs(64, 16)
    rng = np.random.default_rng(prompt + prefix)
    held = prefix % 64
    src_pages = shuffled_pages(rng, -(-(prompt - (prefix - held)) // 64), 64)
    dst_pages = shuffled_pages(rng, -(-(prompt - prefix) // 16), 16)
    info = pair.parse(24, pair.metadata(24, dst_pages, prefix=prefix))
    sent = pair.send_chunks(info, src_pages.astype(np.int64), [0, len(src_pages)])
    assert sent == [0] * (len(src_pages) > 0)  # 64 of 64: sglang's prefill sends no page
    deliver_status(pair.prefill, pair.decode, 24, KV_POLL_SUCCESS)
    assert pair.decode.request_status[24] == KV_POLL_SUCCESS, pair.decode.failure_records
    np.testing.assert_array_equal(
        pair.destination.tensor.numpy(), pair.expected_pool(src_pages, dst_pages, held=held)
    )


def test_a_prefix_not_of_whole_decode_pages_fails_the_request_before_any_byte(pairs):
    pair = pairs(64, 16)
    frames = pair.metadata(13, np.arange(4, dtype=np.int32), prefix=40)
    assert REPAGED_TAG not in frames and frames[4] == b""
    assert pair.decode.request_status[13] == KV_POLL_FAILED
    reason = pair.decode.failure_records[13]
    assert "prefill page size 64, decode page size 16" in reason and "40 tokens" in reason
    info = pair.parse(13, frames)
    assert len(info.dst_kv_indices) == 0  # no page: no KV goes


def test_a_prefix_of_whole_prefill_pages_is_served(pairs):
    pair = pairs(16, 64)
    rng = np.random.default_rng(6)
    src_pages, dst_pages = shuffled_pages(rng, 12, 16), shuffled_pages(rng, 3, 64)
    info = pair.parse(14, pair.metadata(14, dst_pages, prefix=128))
    assert pair.send_chunks(info, src_pages.astype(np.int64), [0, 5, 12]) == [0, 0]
    deliver_status(pair.prefill, pair.decode, 14, KV_POLL_SUCCESS)
    assert pair.decode.request_status[14] == KV_POLL_SUCCESS
    np.testing.assert_array_equal(
        pair.destination.tensor.numpy(), pair.expected_pool(src_pages, dst_pages)
    )


def test_a_chunk_left_unsent_fails_the_request(pairs):
    """A rank whose chunks skip some of the sent tokens: its Success is Failed."""
    pair = pairs(16, 64)
    rng = np.random.default_rng(7)
    src_pages, dst_pages = shuffled_pages(rng, 12, 16), shuffled_pages(rng, 3, 64)
    info = pair.parse(15, pair.metadata(15, dst_pages))
    assert pair.send_chunks(info, src_pages.astype(np.int64), [0, 5]) == [0]
    assert pair.send_chunks(info, src_pages.astype(np.int64), [8, 12]) == [0]
    deliver_status(pair.prefill, pair.decode, 15, KV_POLL_SUCCESS)
    assert pair.decode.request_status[15] == KV_POLL_FAILED
    assert "up to 80, then from 128" in pair.decode.failure_records[15]


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("state_types", [conn.StateType.SWA], "swa is laid out per page"),
        ("mla_compression_ratios", [4, 128, 4, 128], "DeepSeek-V4's HiSparse host pages"),
    ],
)
def test_a_decode_it_cannot_serve_keeps_sglangs_refusal_and_says_why(
    monkeypatch, pairs, field, value, reason
):
    """State laid out per page, DeepSeek-V4's compressed HiSparse pages: sglang's own error,
    naming both page sizes, and why."""
    pair = pairs(64, 16)
    setattr(pair.decode.kv_args, field, value)
    page_sizes.DECODES.release(pair.decode)
    with pytest.raises(RuntimeError, match=f"page_size=64.*page_size=16.*{reason}"):
        pair.connect(monkeypatch)
    assert BOOTSTRAP not in pair.decode.prefill_info_table


def test_equal_page_sizes_go_as_today(monkeypatch, pairs):
    """The same page size: sglang's frames as they are, no virtual page."""
    pair = pairs(16, 16)
    frames = pair.metadata(16, np.arange(3, dtype=np.int32))
    assert REPAGED_TAG not in frames
    np.testing.assert_array_equal(pair.parse(16, frames).dst_kv_indices, np.arange(3))


def test_mla_flat_entries_land_every_sent_token(pairs):
    """MLA: sglang's flat entries (one per buffer, by position)."""
    pair = pairs(16, 64, mla=True)
    rng = np.random.default_rng(8)
    src_pages, dst_pages = shuffled_pages(rng, 40, 16), shuffled_pages(rng, 10, 64)
    info = pair.parse(17, pair.metadata(17, dst_pages))
    assert pair.send_chunks(info, src_pages.astype(np.int64), [0, 16, 40]) == [0, 0]
    deliver_status(pair.prefill, pair.decode, 17, KV_POLL_SUCCESS)
    assert pair.decode.request_status[17] == KV_POLL_SUCCESS
    np.testing.assert_array_equal(
        pair.destination.tensor.numpy(), pair.expected_pool(src_pages, dst_pages)
    )


def test_pipeline_stages_each_send_their_layers_and_both_must_declare(pairs):
    """Prefill PP 2: each stage (its own process, its own parse of the metadata) sends its
    layer's K and V; the request succeeds once both stages declared every sent token, and the
    pool holds every layer's tokens."""
    pair = pairs(64, 16)
    rng = np.random.default_rng(9)
    src_pages, dst_pages = shuffled_pages(rng, 10, 64), shuffled_pages(rng, 40, 16)
    frames = pair.metadata(18, dst_pages)
    pair.decode.required_prefill_response_num_table[18] = 2
    for stage in range(2):
        buffers = [stage, 2 + stage]  # this layer's K and V
        prefill = make_prefill_manager(
            pair.prefill.engine,
            pp_size=2,
            start_layer=stage,
            end_layer=stage + 1,
            kv_data_ptrs=[pair.source.ptrs[b] for b in buffers],
            kv_data_lens=[pair.source.lens[b] for b in buffers],
            pp_rank=stage,
        )
        prefill.kv_args.page_size = 64
        prefill.decode_kv_args_table = pair.prefill.decode_kv_args_table
        info = conn.TransferInfo.from_zmq(frames)  # this stage's own parse
        prefill.transfer_infos[18] = {pair.session: info}
        status = hooked_send()(
            prefill,
            mooncake_session_id=pair.session,
            src_data_ptrs=[pair.source.ptrs[b] for b in buffers],
            dst_data_ptrs=pair.destination.ptrs,
            item_lens=[pair.source.item_lens[b] for b in buffers],
            prefill_data_indices=src_pages.astype(np.int64),
            dst_data_indices=info.dst_kv_indices[: len(src_pages)],
            executor=None,
        )
        assert status == 0
        deliver_status(prefill, pair.decode, 18, KV_POLL_SUCCESS)
        assert pair.decode.request_status[18] != KV_POLL_FAILED, pair.decode.failure_records
    assert pair.decode.request_status[18] == KV_POLL_SUCCESS
    np.testing.assert_array_equal(
        pair.destination.tensor.numpy(), pair.expected_pool(src_pages, dst_pages)
    )


def test_a_context_parallel_prefill_keeps_sglangs_refusal(monkeypatch, pairs):
    """Prefill CP splits a request's tokens across ranks: sglang's error, and why."""
    pair = pairs(64, 16)
    pair.decode.prefill_info_table.clear()
    route = {**route_answer(64), "attn_cp_size": 2}
    answer = types.SimpleNamespace(status_code=200, json=lambda: route)
    monkeypatch.setattr(common_conn.requests, "get", lambda url, timeout: answer)
    with pytest.raises(RuntimeError, match="Page size mismatch.*context parallelism"):
        conn.MooncakeKVManager.try_ensure_parallel_info(pair.decode, BOOTSTRAP)


HEAD_BYTES = 8
SLICE_EXECUTOR = concurrent.futures.ThreadPoolExecutor(2)  # sglang's per-layer calls


@pytest.mark.parametrize(("prefill_page_size", "decode_page_size"), [(64, 16), (16, 64), (16, 1)])
@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "staged"), [(2, 1, False), (1, 2, False), (2, 1, True)]
)
def test_head_slices_between_attention_tp_sizes_land_every_sent_token(
    request, prefill_page_size, decode_page_size, prefill_tp, decode_tp, staged
):
    """MHA with 4 KV heads, prefill TP 2 -> decode TP 1 (each prefill rank sends its heads into
    every decode token: both must declare) and TP 1 -> TP 2 (the prefill sends each decode rank
    its heads; here rank 1): every sent token's head slice in its decode slot. `staged`: the
    decode lends receive staging, and each TP-down rank's share of every token goes there and
    is scattered into the decode's slots."""
    pairs = request.getfixturevalue("staged_pairs" if staged else "pairs")
    heads = 4
    prefill_heads, decode_heads = heads // prefill_tp, heads // decode_tp
    layers = 2
    widths = ([prefill_heads * HEAD_BYTES] * 2 * layers, [decode_heads * HEAD_BYTES] * 2 * layers)
    pair = pairs(prefill_page_size, decode_page_size, token_bytes=widths)
    rng = np.random.default_rng(prefill_page_size + decode_page_size + prefill_tp)
    tokens = 300
    src_pages = shuffled_pages(rng, -(-tokens // prefill_page_size), prefill_page_size)
    dst_pages = shuffled_pages(rng, -(-tokens // decode_page_size), decode_page_size)
    frames = pair.metadata(19, dst_pages)
    pair.decode.required_prefill_response_num_table[19] = max(prefill_tp // decode_tp, 1)
    expected = None
    decode_rank = 1 if decode_tp > 1 else 0
    before = counters.snapshot()["sends"]
    ranks = max(prefill_tp // decode_tp, 1)
    for rank in range(ranks):
        prefill = make_prefill_manager(
            pair.prefill.engine,
            kv_data_ptrs=pair.source.ptrs,
            kv_data_lens=pair.source.lens,
            attn_tp_rank=rank,
        )
        prefill.attn_tp_size = prefill_tp
        kv_args = prefill.kv_args
        kv_args.page_size, kv_args.kv_item_lens = prefill_page_size, pair.source.item_lens
        kv_args.kv_layer_ids, kv_args.engine_rank = [], rank
        kv_args.kv_head_num, kv_args.total_kv_head_num = prefill_heads, heads
        prefill.decode_kv_args_table = pair.prefill.decode_kv_args_table
        pair.keep_notes(prefill)
        info = conn.TransferInfo.from_zmq(frames)  # this rank's own parse
        prefill.transfer_infos[19] = {pair.session: info}
        cuts = [0, len(src_pages) // 2, len(src_pages)]
        for first, end in zip(cuts[:-1], cuts[1:], strict=True):
            status = conn.MooncakeKVManager.send_kvcache_slice(
                prefill,
                pair.session,
                src_pages[first:end].astype(np.int64),
                pair.destination.ptrs,
                info.dst_kv_indices[first:end],
                decode_rank,
                decode_tp,
                pair.destination.item_lens[0],
                SLICE_EXECUTOR,
            )
            assert status == 0
        send_slots.SEND_SLOTS.release(prefill)
        assert pair.deliver_notes() == (2 if staged else 0)
        deliver_status(prefill, pair.decode, 19, KV_POLL_SUCCESS)
        # prefill rank r holds heads [r * prefill_heads, ...); decode rank d [d * decode_heads, ...)
        first_head = max(rank * prefill_heads, decode_rank * decode_heads)
        sent_heads = min(prefill_heads, decode_heads) * HEAD_BYTES
        src_offset = (first_head - rank * prefill_heads) * HEAD_BYTES
        dst_offset = (first_head - decode_rank * decode_heads) * HEAD_BYTES
        expected = pair.expected_pool(
            src_pages, dst_pages, (src_offset, dst_offset, sent_heads), expected
        )
    assert pair.decode.request_status[19] == KV_POLL_SUCCESS, pair.decode.failure_records
    np.testing.assert_array_equal(pair.destination.tensor.numpy(), expected)
    # TP-up: gathered into send slots as whole (unit) decode pages; TP-down: per token, or
    # staged into the decode's receive staging.
    path = "gathered/arrays" if prefill_tp < decode_tp else "slice/arrays"
    path = "staged/arrays" if staged else path
    assert counters.snapshot()["sends"].get(path, 0) - before.get(path, 0) == 2 * ranks, (
        counters.snapshot()["paths_chosen"]
    )


@pytest.mark.parametrize(
    ("bag", "setting", "reason"),
    [
        ("disagg", "disaggregation_enable_kv_checksum", "KV checksum digests whole pages"),
        ("memory", "enable_unified_memory", "unified memory registers one envelope"),
    ],
)
def test_a_setting_that_addresses_pages_keeps_sglangs_refusal(
    monkeypatch, pairs, bag, setting, reason
):
    pair = pairs(64, 16)
    page_sizes.DECODES.release(pair.decode)
    monkeypatch.setattr(
        runtime_context, f"get_{bag}", lambda: types.SimpleNamespace(**{setting: True})
    )
    with pytest.raises(RuntimeError, match=f"Page size mismatch.*{reason}"):
        pair.connect(monkeypatch)


def test_the_decodes_radix_cache_connects_to_a_coarser_or_finer_prefill(monkeypatch, pairs):
    """Prefix hits in whole decode pages are served from either (above): both connect."""
    fine, coarse = pairs(16, 64), pairs(64, 16)
    flags = types.SimpleNamespace(disaggregation_decode_enable_radix_cache=True)
    monkeypatch.setattr(runtime_context, "get_disagg", lambda: flags)
    for pair in (fine, coarse):
        assert pair.connect(monkeypatch)
        assert pair.decode.prefill_info_table[BOOTSTRAP].page_size == pair.prefill_page_size

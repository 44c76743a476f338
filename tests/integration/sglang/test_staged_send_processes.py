"""A staged send between two processes through real Mooncake (TCP on 127.0.0.1), both sides'
KV on a device: on a GPU (`cuda`: both processes on the same one, real CUDA memory, the
kernels compiled by warm-up), or without one (`stand-in`: host memory standing for cuda:0
through the CUDA stand-in, the kernels under the Triton interpreter).

The prefill is this process: a real `MooncakeKVManager` whose hooked send gathers each
piece into a device slot and writes it to the decode's device region. The decode is a
process of its own (`staged_decode_peer.decode_peer`) whose hooked handlers scatter the
pieces into its pool. Its pool must then hold what sglang's own send (unhooked) lands in
a reference pool of the same process, and neither process may compile a Triton kernel
after warm-up. `scripts/gpu_check.sh sglang` runs the `cuda` case on a GPU.
"""

from __future__ import annotations

import concurrent.futures
import time
import warnings

import numpy as np
import pytest
from sglang_plugin_support import ORIGINALS, conn, hooked_send, make_manager
from staged_decode_peer import (
    POOL_PAGES,
    CountedCalls,
    DeviceKV,
    Placement,
    count_compiles,
    decode_peer,
)
from suite_support import ON_CUDA, set_knob

from gpu_planner import settings
from gpu_planner.integration.mooncake.engine import engine_process
from gpu_planner.integration.sglang import prefill_routes, send_slots
from gpu_planner.integration.sglang.staging_wire import STAGED_TAG
from gpu_planner.kernels import head_gather, interpreter_enabled

KV_POLL_SUCCESS = 4
REPLY_TIMEOUT_S = 120.0  # the decode's start includes its warm-up's compiles on a GPU
SEND_EXECUTOR = concurrent.futures.ThreadPoolExecutor(1)


@pytest.fixture(
    params=[
        pytest.param(
            "stand-in",
            marks=pytest.mark.skipif(
                not interpreter_enabled(), reason="the stand-in's kernels need the interpreter"
            ),
        ),
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not ON_CUDA, reason="no CUDA device (stand-in runs)")
        ),
    ]
)
def placement(request) -> Placement:
    return Placement(request.param)


@pytest.fixture(scope="module")
def prefill_engine():
    """sglang's Mooncake wrapper, TCP on 127.0.0.1; the decode process inherits the setting."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MOONCAKE_PROTOCOL", "tcp")
        env.setenv("MC_FORCE_TCP", "1")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
                MooncakeTransferEngine,
            )
        yield MooncakeTransferEngine("127.0.0.1")


@pytest.fixture
def staging_knobs(monkeypatch):
    """Every send of 8+ descriptors staged through 16 KiB slots (the decode inherits them)."""
    set_knob(monkeypatch, settings.STAGING_MIN_DESCRIPTORS.name, "8")
    set_knob(monkeypatch, settings.RECEIVE_STAGING_BYTES.name, str(4 << 20))
    set_knob(monkeypatch, settings.GATHER_STAGING_BYTES.name, str(64 << 10))
    settings.load()
    yield
    prefill_routes.ROUTES.forget()


class Decode:
    """The decode process and its pipe."""

    def __init__(self, kind: str, item_lens: list[int], device_buffers: int) -> None:
        import multiprocessing

        self.connection, child_end = multiprocessing.Pipe()
        self.process = engine_process(decode_peer, (child_end, kind, item_lens, device_buffers))
        self.process.start()
        child_end.close()
        self.session, self.registration, self.device_ptrs, self.reference_ptrs = self.reply()

    def reply(self):
        if not self.connection.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"decode {self.process.pid} sent nothing in {REPLY_TIMEOUT_S} s")
        return self.connection.recv()

    def ask(self, *message):
        self.connection.send(message)
        return self.reply()

    def close(self) -> None:
        self.connection.close()
        self.process.join(30)
        self.process.kill()


def fragmented(rng: np.random.Generator, count: int, dtype=np.int32) -> np.ndarray:
    """`count` distinct pool pages in runs of about two, shuffled."""
    runs = np.arange(POOL_PAGES).reshape(-1, 2)[rng.permutation(POOL_PAGES // 2)]
    return runs.reshape(-1)[:count].astype(dtype)


@pytest.mark.parametrize(
    ("item_lens", "device_buffers", "chunks"),
    [
        ([256] * 16, 0, 3),  # MHA K/V of 8 layers, fragmented, three chunks of one request
        ([192] * 6 + [64] * 2, 2, 1),  # HiSparse: two device-backed buffers, their own pages
    ],
)
def test_a_staged_send_between_two_processes_lands_sglangs_bytes_and_compiles_nothing(
    request, prefill_engine, staging_knobs, placement, item_lens, device_buffers, chunks
):
    runtime = None if placement.kind == "cuda" else request.getfixturevalue("host_cuda")
    decode = Decode(placement.kind, item_lens, device_buffers)
    source = DeviceKV(prefill_engine, item_lens, 11 + chunks, placement, runtime)
    prefill = make_manager(prefill_engine, kv_data_ptrs=source.ptrs, kv_data_lens=source.lens)
    try:
        notes: list[list[bytes]] = []
        prefill._send_multipart_locked = lambda _, parts, is_ipv6=False: notes.append(parts)
        registration = conn.KVArgsRegisterInfo.from_zmq(decode.registration)
        prefill.decode_kv_args_table = {decode.session: registration}
        placement.warm_up()
        rng = np.random.default_rng(chunks)
        num_pages = 48
        src_pages = fragmented(rng, num_pages, np.int64)
        host_pages = fragmented(rng, num_pages)
        device_pages = fragmented(rng, num_pages) if device_buffers else None
        reference_device = set(decode.reference_ptrs[len(item_lens) - device_buffers :])
        status = ORIGINALS["send"](
            prefill,
            mooncake_session_id=decode.session,
            src_data_ptrs=source.ptrs,
            dst_data_ptrs=decode.reference_ptrs,
            item_lens=item_lens,
            prefill_data_indices=src_pages,
            dst_data_indices=host_pages,
            executor=None,
            dst_device_data_indices=device_pages,
            dst_device_data_ptrs=reference_device or None,
        )
        assert status == 0
        info = conn.TransferInfo.from_zmq(decode.ask("request", 7, host_pages, device_pages))
        prefill.transfer_infos[7] = {decode.session: info}
        patch = request.getfixturevalue("monkeypatch").setattr
        compiles = count_compiles(patch)
        gathers = CountedCalls(head_gather, "launch_gather_head_slices", patch)
        cuts = np.linspace(0, num_pages, chunks + 1).astype(int)
        for first, end in zip(cuts[:-1], cuts[1:], strict=True):
            status = hooked_send()(
                prefill,
                mooncake_session_id=decode.session,
                src_data_ptrs=source.ptrs,
                dst_data_ptrs=registration.dst_kv_ptrs,
                item_lens=item_lens,
                prefill_data_indices=src_pages[first:end],
                dst_data_indices=info.dst_kv_indices[first:end],
                executor=SEND_EXECUTOR,
                dst_device_data_indices=None if device_pages is None else device_pages[first:end],
                dst_device_data_ptrs=set(decode.device_ptrs) or None,
            )
            assert status == 0
        assert len(notes) == chunks and all(note[0] == STAGED_TAG for note in notes)
        pieces = sum(len(note[8]) // 16 for note in notes)  # (page_start, pages) pairs
        status_frames = conn.MooncakeKVManager._encode_kv_status_message(
            prefill, bootstrap_room=7, status=KV_POLL_SUCCESS, failure_reason=None
        )
        landed = decode.ask("deliver", 7, notes, status_frames)
        assert landed["status"] == KV_POLL_SUCCESS
        assert landed["pool"] == landed["reference"]
        assert np.frombuffer(landed["reference"], np.uint8).any()  # sglang's send moved bytes
        assert (landed["region"], send_slots.SEND_SLOTS.get(prefill).torch_device.type) == (
            "cuda",
            "cuda",
        )
        assert (gathers.count, landed["scatters"]) == (pieces, pieces)  # one kernel per piece
        assert (compiles.count, landed["compiles"]) == (0, 0)
        assert landed["lent_rooms"] == 0 and all_slots_back(send_slots.SEND_SLOTS.get(prefill))
    finally:
        decode.close()
        send_slots.SEND_SLOTS.release(prefill)
        source.close()


def all_slots_back(staging: send_slots.SendSlots, within_s: float = 60.0) -> bool:
    """Whether every send slot is free once the engine calls still reading one end."""
    deadline = time.monotonic() + within_s
    while staging.free_slots != send_slots.SLOTS:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True

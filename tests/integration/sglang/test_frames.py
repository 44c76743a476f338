"""Decode-side metadata frames: round trips, and sglang 0.5.23's own parsers accept them."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gpu_planner as gp
from gpu_planner.integration.sglang.frames import (
    SGLANG_REGISTRATION_FRAMES,
    FrameError,
    KVRegistration,
    SourcePages,
    TransferRequest,
)

page_arrays = st.lists(st.integers(0, 2**31 - 1), max_size=64).map(
    lambda pages: np.array(pages, dtype=np.int64)
)


def _sglang_conn():
    """sglang's Mooncake connector module (the real package; the test set-up installs it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no GPU quantization kernels on this machine
        from sglang.srt.disaggregation.mooncake import conn
    return conn


def _request(host_pages: np.ndarray, device_pages: np.ndarray | None) -> TransferRequest:
    return TransferRequest(
        room=2**40 + 3,
        endpoint="127.0.0.1",
        port=17001,
        session_id="127.0.0.1:15123",
        host_pages=host_pages,
        device_pages=device_pages,
        aux_index=5,
        required_dst_info_num=2,
        decode_prefix_len=128,
    )


@given(host=page_arrays, device=page_arrays, with_device=st.booleans())
def test_transfer_request_round_trip(host, device, with_device):
    device = np.resize(device, host.size) if with_device else None
    parsed = TransferRequest.from_frames(_request(host, device).to_frames())
    np.testing.assert_array_equal(parsed.host_pages, host)
    if with_device or not host.size:
        np.testing.assert_array_equal(parsed.device_pages, device if with_device else [])
    else:
        assert parsed.device_pages is None
    assert (parsed.room, parsed.port, parsed.aux_index) == (2**40 + 3, 17001, 5)
    assert (parsed.required_dst_info_num, parsed.decode_prefix_len) == (2, 128)


@pytest.mark.parametrize("with_device", [True, False], ids=["hisparse", "host-only"])
@pytest.mark.parametrize("num_pages", [0, 1, 37])
def test_sglang_transfer_info_accepts_the_frames(num_pages, with_device):
    conn = _sglang_conn()
    rng = np.random.default_rng(num_pages)
    host = rng.permutation(1000)[:num_pages]
    device = rng.permutation(500)[:num_pages] if with_device else None
    info = conn.TransferInfo.from_zmq(_request(host, device).to_frames())
    assert not info.is_dummy
    assert (info.room, info.endpoint, info.dst_port) == (2**40 + 3, "127.0.0.1", 17001)
    assert info.mooncake_session_id == "127.0.0.1:15123"
    assert info.dst_kv_indices.dtype == np.int32
    np.testing.assert_array_equal(info.dst_kv_indices, host)
    assert (info.dst_aux_index, info.dst_state_indices) == (5, [])
    assert (info.required_dst_info_num, info.decode_prefix_len) == (2, 128)
    if with_device and num_pages:
        np.testing.assert_array_equal(info.dst_device_kv_indices, device)
    else:
        assert info.dst_device_kv_indices is None


def _registration() -> KVRegistration:
    return KVRegistration(
        endpoint="127.0.0.1",
        port=17002,
        session_id="127.0.0.1:15124",
        ptrs=[2**47 + 4096 * i for i in range(5)],
        item_lens=[512, 512, 256, 512, 1024],
        lens=[512 * 100, 512 * 100, 256 * 80, 512 * 100, 1024 * 7],
        is_device=[False, True, True, False, True],
        aux_ptrs=[2**40, 2**40 + 64],
        tp_rank=3,
        attn_tp_size=4,
    )


def test_registration_round_trip():
    registration = _registration()
    assert KVRegistration.from_frames(registration.to_frames()) == registration


def test_registration_of_another_version_is_refused():
    frames = _registration().to_frames()
    frames[SGLANG_REGISTRATION_FRAMES] = b"gpu_planner.registration/0"
    with pytest.raises(ValueError, match="version b'gpu_planner.registration/0'"):
        KVRegistration.from_frames(frames)


def test_sglang_kv_args_register_info_accepts_the_registration():
    conn = _sglang_conn()
    registration = _registration()
    info = conn.KVArgsRegisterInfo.from_zmq(registration.to_frames())
    assert info.room == "None"
    assert (info.endpoint, info.dst_port) == ("127.0.0.1", 17002)
    assert info.mooncake_session_id == "127.0.0.1:15124"
    assert info.dst_kv_ptrs == registration.ptrs
    assert info.dst_kv_item_lens == registration.item_lens
    assert info.dst_kv_item_len == registration.item_lens[0]
    assert info.dst_aux_ptrs == registration.aux_ptrs
    assert (info.dst_tp_rank, info.dst_attn_tp_size) == (3, 4)
    assert (info.dst_state_data_ptrs, info.staging) == ([], None)


@pytest.mark.parametrize(
    ("pages", "message"),
    [
        (np.array([3, -1]), r"host_pages\[1\] = -1"),
        (np.array([2**31]), r"host_pages\[0\] = 2147483648"),
        (np.array([[1, 2]]), "1-D integer"),
        (np.array([1.5]), "1-D integer"),
    ],
)
def test_pages_that_int32_frames_cannot_hold_are_refused(pages, message):
    with pytest.raises(ValueError, match=message):
        _request(pages, None).to_frames()


def test_registration_needs_one_entry_per_buffer():
    with pytest.raises(ValueError, match="lens: has 1 entries for 2 buffers"):
        KVRegistration("127.0.0.1", 1, "s", [0, 64], [64, 64], [640], [False, False])


def test_frames_of_the_other_message_are_refused():
    with pytest.raises(ValueError, match="not a transfer request"):
        TransferRequest.from_frames(_registration().to_frames())
    with pytest.raises(ValueError, match="not a gpu_planner.registration/1 KV registration"):
        KVRegistration.from_frames(_request(np.arange(3), None).to_frames())


@given(pages=page_arrays)
def test_source_pages_round_trip(pages):
    parsed = SourcePages.from_frames(SourcePages(7, "127.0.0.1:15125", pages).to_frames())
    np.testing.assert_array_equal(parsed.pages, pages)
    assert (parsed.room, parsed.session_id) == (7, "127.0.0.1:15125")
    with pytest.raises(ValueError, match="not a source-pages message"):
        SourcePages.from_frames(_request(pages, None).to_frames())


@pytest.mark.parametrize("with_device", [True, False], ids=["hisparse", "host-only"])
def test_transfer_request_for_pending_pages(with_device):
    rng = np.random.default_rng(4)
    device_slots, host_slots = rng.permutation(400)[:90], rng.permutation(900)[:90]
    pending = gp.page_indices_async(
        torch.from_numpy(device_slots), torch.from_numpy(host_slots), 2, 90, 8
    )
    fields = {"room": 3, "endpoint": "127.0.0.1", "port": 17003, "session_id": "127.0.0.1:1"}
    host = pending.numpy()
    device_pages = host.device if with_device else None
    request = TransferRequest(host_pages=host.host, device_pages=device_pages, **fields)
    parsed = TransferRequest.from_frames(request.to_frames())
    np.testing.assert_array_equal(parsed.host_pages, host_slots[2:90:8] // 8)
    if with_device:
        np.testing.assert_array_equal(parsed.device_pages, device_slots[2:90:8] // 8)
    else:
        assert parsed.device_pages is None
    assert (parsed.room, parsed.port) == (3, 17003)


MESSAGES = {
    "registration": (KVRegistration, lambda: _registration().to_frames()),
    "request": (TransferRequest, lambda: _request(np.arange(5), np.arange(5)).to_frames()),
    "source pages": (SourcePages, lambda: SourcePages(7, "127.0.0.1:1", np.arange(3)).to_frames()),
}


@pytest.mark.parametrize("kind", MESSAGES)
def test_a_malformed_message_is_a_frame_error(kind):
    check_malformed(kind)


@given(data=st.data())
def check_malformed(kind, data):
    """Frames dropped, cut short, replaced by other bytes or by numbers: parsed, or a FrameError.

    Never struct.error, IndexError or another exception type.
    """
    parser, make_frames = MESSAGES[kind]
    frames = make_frames()
    for _ in range(data.draw(st.integers(1, 3))):
        index = data.draw(st.integers(0, len(frames) - 1))
        edit = data.draw(st.sampled_from(["drop", "cut", "bytes", "number"]))
        if edit == "drop":
            frames = frames[:index] + frames[index + 1 :]
        elif edit == "cut":
            frames[index] = frames[index][: data.draw(st.integers(0, len(frames[index])))]
        elif edit == "bytes":
            frames[index] = data.draw(st.binary(max_size=24))
        else:
            frames[index] = str(data.draw(st.integers(-(2**80), 2**80))).encode()
        if not frames:
            break
    try:
        parser.from_frames(frames)
    except FrameError as error:
        assert str(error)


@pytest.mark.parametrize("port", [b"-1", b"0", b"65536", b"%d" % 2**70, b"80x", b"", b"\xff"])
@pytest.mark.parametrize("kind", ["registration", "request"])
def test_a_port_outside_1_to_65535_does_not_parse(kind, port):
    parser, make_frames = MESSAGES[kind]
    frames = make_frames()
    frames[2] = port
    with pytest.raises(FrameError, match="port"):
        parser.from_frames(frames)


@pytest.mark.parametrize(
    ("kind", "index", "value", "message"),
    [
        ("registration", 4, b"\x00" * 12, r"ptrs: 12 bytes is not a whole number of u64"),
        ("registration", 19, b"\xff" * 8 * 5, r"item_lens\[0\] = 18446744073709551615"),
        ("registration", 21, b"\x00" * 8, r"lens: has 1 entries for 5 buffers"),
        ("registration", 22, b"\x00\x02\x00\x01\x00", "is_device: bytes other than 0 and 1"),
        ("registration", 8, b"0", r"attn_tp_size = 0"),
        ("request", 4, b"\x00" * 6, "host_pages: 6 bytes is not a whole number of int32"),
        ("request", 9, b"\xff\xff\xff\xff" * 5, r"device_pages\[0\] = -1"),
        ("request", 0, b"-5", "room = -5"),
        ("source pages", 1, b"\xe9t\xe9", "session_id: not ASCII"),
    ],
)
def test_a_frame_error_names_the_field(kind, index, value, message):
    parser, make_frames = MESSAGES[kind]
    frames = make_frames()
    frames[index] = value
    with pytest.raises(FrameError, match=message):
        parser.from_frames(frames)
    assert issubclass(FrameError, ValueError)

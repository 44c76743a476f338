"""The real sglang 0.5.23 with gpu_planner's plugin loaded, and a manager to call it on.

Importing this module imports sglang once per test session (about 10 s), keeps
sglang's original functions in `ORIGINALS` (HookRegistry rebinds every
module-level name bound to an original, so a dict is the safe place), then runs
sglang's own `load_plugins()`, which finds gpu_planner through its installed
entry point.
"""

from __future__ import annotations

import inspect
import os
import warnings

import numpy as np
import torch

os.environ.pop("GPU_PLANNER_DISABLE", None)
os.environ.pop("SGLANG_PLUGINS", None)

with warnings.catch_warnings():
    # sglang warns that its GPU quantization kernels are unavailable on this machine.
    warnings.simplefilter("ignore")
    # decode does `from ...common import kv_to_page_indices` (every sglang this supports)
    from sglang.srt.disaggregation import decode as page_importer
    from sglang.srt.disaggregation.mooncake import conn
    from sglang.srt.mem_cache import common
    from sglang.srt.plugins import load_plugins

ORIGINALS = {
    "send": inspect.unwrap(conn.MooncakeKVManager._send_kvcache_generic),
    "pages": inspect.unwrap(common.kv_to_page_indices),
}
load_plugins()

from bench.sglang_manager import (  # noqa: E402  (after sglang's import)
    FailureRecorder,
    RecordingEngine,
    make_decode_manager,
    make_manager,
)

__all__ = [
    "ORIGINALS",
    "KVPool",
    "hooked_metadata",
    "registration_frames",
    "FailureRecorder",
    "RecordingEngine",
    "common",
    "conn",
    "deliver_status",
    "hooked_send",
    "make_decode_manager",
    "make_manager",
    "page_importer",
    "send_outcome",
]


def send_outcome(send, manager: conn.MooncakeKVManager, *args, **kwargs) -> dict:
    """Call `send(manager, ...)`: its status, or the error sglang raised, and its failures."""
    try:
        status, error = send(manager, *args, **kwargs), None
    except Exception as exc:  # sglang's own errors must surface unchanged
        status, error = None, (type(exc), str(exc))
    return {"status": status, "error": error, "failures": manager.conclude_failure.calls}


def hooked_send():
    """The `_send_kvcache_generic` sglang now runs (the plugin's wrapper)."""
    return conn.MooncakeKVManager._send_kvcache_generic


class KVPool:
    """KV buffers of `pages` pages each in one host tensor registered with `engine`."""

    def __init__(
        self, engine, item_lens: list[int], fill: str, seed: int = 0, *, pages: int
    ) -> None:
        self.item_lens = item_lens
        self.pages = pages
        self.offsets = np.cumsum([0] + [pages * n for n in item_lens]).tolist()
        if fill == "random":
            rng = np.random.default_rng(seed)
            data = rng.integers(0, 256, self.offsets[-1], dtype=np.uint8)
        else:
            data = np.zeros(self.offsets[-1], dtype=np.uint8)
        self.tensor = torch.from_numpy(data)
        self.engine = engine
        engine.register(self.tensor.data_ptr(), self.offsets[-1])

    def close(self) -> None:
        self.engine.deregister(self.tensor.data_ptr())

    @property
    def ptrs(self) -> list[int]:
        return [self.tensor.data_ptr() + offset for offset in self.offsets[:-1]]

    @property
    def lens(self) -> list[int]:
        """Each buffer's registered bytes (the side's `kv_args.kv_data_lens`)."""
        return [self.pages * n for n in self.item_lens]

    def page(self, buffer: int, page: int) -> slice:
        item_len = self.item_lens[buffer]
        start = self.offsets[buffer] + page * item_len
        return slice(start, start + item_len)


def registration_frames(pool, session: str) -> list[bytes]:
    """sglang's 20 KV-registration frames of a decode at `session` whose KV buffers are `pool`'s
    (its `ptrs`, `item_lens`, `lens`), before any hook adds to them."""
    from gpu_planner.integration.sglang.frames import KVRegistration

    return KVRegistration(
        endpoint="127.0.0.1",
        port=17000,
        session_id=session,
        ptrs=pool.ptrs,
        item_lens=pool.item_lens,
        lens=pool.lens,
        is_device=[False] * len(pool.ptrs),
    ).to_frames()[:20]


def hooked_metadata(
    decode, room: int, session: str, host_pages, device_pages=None, prefix: int = 0
) -> list[bytes]:
    """A decode's metadata for `room` through the hooked builder (`receive_staging`): sglang's
    ten frames, made from what the hooks pass sglang's builder, and what the hooks add."""
    from gpu_planner.integration.sglang import receive_staging
    from gpu_planner.integration.sglang.frames import TransferRequest

    def build(_, **kwargs) -> list[bytes]:
        return TransferRequest(
            room=room,
            endpoint="127.0.0.1",
            port=17000,
            session_id=session,
            host_pages=kwargs["kv_indices"],
            device_pages=kwargs["device_kv_indices"],
            decode_prefix_len=kwargs["decode_prefix_len"],
        ).to_frames()

    return receive_staging.metadata_message_hook(
        build,
        decode,
        bootstrap_room=room,
        required_dst_info_num=1,
        kv_indices=host_pages,
        aux_index=0,
        state_indices=None,
        decode_prefix_len=prefix,
        is_dummy=False,
        device_kv_indices=device_pages,
    )


def deliver_status(prefill, decode, room: int, status: int, failure_reason=None) -> None:
    """A prefill rank's status, as sglang moves it: encoded by the prefill's manager, parsed
    and applied by the decode's (hooked, both sides), as `start_decode_thread` does."""
    frames = conn.MooncakeKVManager._encode_kv_status_message(
        prefill, bootstrap_room=room, status=status, failure_reason=failure_reason
    )
    parsed = conn.MooncakeKVManager.parse_kv_status_message(decode, frames)
    assert parsed is not None, frames
    parsed_room, parsed_status, prefill_rank, reason = parsed
    conn.MooncakeKVManager.apply_prefill_status(
        decode,
        bootstrap_room=parsed_room,
        status=parsed_status,
        prefill_rank=prefill_rank,
        failure_reason=reason,
    )

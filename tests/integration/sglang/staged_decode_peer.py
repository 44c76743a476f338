"""A decode in a process of its own, for staged sends between two processes.

`decode_peer` (run with `engine.engine_process`) starts sglang's Mooncake
wrapper on 127.0.0.1 (TCP), allocates its KV pool and a reference pool on a
device (a GPU, or host memory standing for device 0 through the CUDA stand-in),
builds a real decode `MooncakeKVManager`, warms the kernels up on a GPU, and
then answers the prefill over a pipe: its registration message, each
request's metadata message, and the delivery of the prefill's notes and
status, after which it sends back what its pool and the reference pool hold,
the request's status, the scatters it ran and the Triton compiles since
warm-up. Messages go through the plugin's hooked builders and handlers, as in
`test_receive_staging_mooncake.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from multiprocessing.connection import Connection

import numpy as np
import torch

PAGE_SIZE = 4
POOL_PAGES = 128
KV_POLL_TRANSFERRING = 3


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a side's KV lives: `cuda` (a GPU) or `stand-in` (host memory standing for cuda:0)."""

    kind: str

    def device(self) -> torch.device:
        return torch.device("cuda", 0) if self.kind == "cuda" else torch.device("cpu")

    def runtime(self):
        """The CUDA stand-in for this process (stand-in), else a no-op context."""
        if self.kind == "cuda":
            return contextlib.nullcontext()
        from cuda_standin import HostCudaRuntime

        from gpu_planner.cuda_runtime import use_cuda_runtime

        return use_cuda_runtime(HostCudaRuntime())

    def warm_up(self) -> None:
        """Compile every kernel variant on the GPU (the interpreter compiles nothing)."""
        if self.kind == "cuda":
            import gpu_planner as gp

            gp.warmup(self.device())


class DeviceKV:
    """`POOL_PAGES` pages per buffer in one tensor on `placement`'s device, registered."""

    def __init__(self, engine, item_lens: list[int], seed: int | None, placement, runtime):
        self.item_lens = item_lens
        self.offsets = np.cumsum([0] + [POOL_PAGES * n for n in item_lens]).tolist()
        data = np.zeros(self.offsets[-1], dtype=np.uint8)
        if seed is not None:
            data = np.random.default_rng(seed).integers(0, 256, data.size, dtype=np.uint8)
        self.tensor = torch.from_numpy(data).to(placement.device())
        if placement.kind != "cuda":
            runtime.place(self.tensor, 0)
        self.engine = engine
        engine.register(self.tensor.data_ptr(), self.offsets[-1])

    @property
    def ptrs(self) -> list[int]:
        return [self.tensor.data_ptr() + offset for offset in self.offsets[:-1]]

    @property
    def lens(self) -> list[int]:
        return [POOL_PAGES * n for n in self.item_lens]

    def contents(self) -> bytes:
        return self.tensor.cpu().numpy().tobytes()

    def close(self) -> None:
        self.engine.deregister(self.tensor.data_ptr())


class CountedCalls:
    """Counts calls of `owner.name` from now on (this process), wrapped in with `setattr`
    (a test's `monkeypatch.setattr` undoes it)."""

    def __init__(self, owner, name: str, setattr=setattr) -> None:
        self.count = 0
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)


def count_compiles(setattr=setattr) -> CountedCalls:
    """Triton's JIT compiles in this process from now on (each new specialisation is one)."""
    from triton.runtime.jit import JITFunction

    return CountedCalls(JITFunction, "_do_compile", setattr)


def decode_peer(connection: Connection, kind: str, item_lens: list[int], device_buffers: int):
    """The decode process: serve the pipe until it closes (see the module's docstring)."""
    placement = Placement(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            MooncakeTransferEngine,
        )
    from sglang_plugin_support import conn, make_decode_manager, registration_frames

    from gpu_planner.integration.sglang import receive_staging
    from gpu_planner.kernels import head_scatter

    with placement.runtime() as runtime:
        engine = MooncakeTransferEngine("127.0.0.1")
        pool = DeviceKV(engine, item_lens, None, placement, runtime)
        reference = DeviceKV(engine, item_lens, None, placement, runtime)
        decode = make_decode_manager(
            engine, pool.ptrs, pool.lens, item_lens, PAGE_SIZE, num_draft_entries=device_buffers
        )
        placement.warm_up()
        compiles = count_compiles()
        scatters = CountedCalls(head_scatter, "launch_scatter_head_slices")
        frames = registration_frames(pool, engine.session_id)
        frames = receive_staging.registration_message_hook(lambda _: frames, decode)
        first_device = len(item_lens) - device_buffers
        connection.send((engine.session_id, frames, pool.ptrs[first_device:], reference.ptrs))
        with contextlib.suppress(EOFError):  # the prefill closed the pipe or exited
            while True:
                message = connection.recv()
                if message[0] == "request":  # ("request", room, host pages, device pages)
                    connection.send(_metadata(decode, engine.session_id, *message[1:]))
                else:  # ("deliver", room, notes, status frames): sglang's decode thread's order
                    _, room, notes, status_frames = message
                    for note in notes:
                        if not conn.MooncakeKVManager.handle_chunk_ready(decode, note):
                            conn.MooncakeKVManager.parse_kv_status_message(decode, note)
                    parsed = conn.MooncakeKVManager.parse_kv_status_message(decode, status_frames)
                    parsed_room, status, prefill_rank, reason = parsed
                    conn.MooncakeKVManager.apply_prefill_status(
                        decode,
                        bootstrap_room=parsed_room,
                        status=status,
                        prefill_rank=prefill_rank,
                        failure_reason=reason,
                    )
                    region = receive_staging.REGIONS.existing(decode)
                    connection.send(
                        {
                            "status": decode.request_status[room],
                            "pool": pool.contents(),
                            "reference": reference.contents(),
                            "scatters": scatters.count,
                            "compiles": compiles.count,
                            "region": region.torch_device.type,
                            "lent_rooms": region.lent_rooms,
                        }
                    )
        receive_staging.REGIONS.release(decode)
        pool.close()
        reference.close()


def _metadata(
    decode, session: str, room: int, host_pages: np.ndarray, device_pages: np.ndarray | None
):
    """The decode's metadata message for `room`, built through the plugin's hook."""
    from sglang_plugin_support import hooked_metadata  # after sglang's import (`serve`)

    decode.request_status[room] = KV_POLL_TRANSFERRING
    decode.prefill_response_tracker[room] = set()
    decode.required_prefill_response_num_table[room] = 1
    return hooked_metadata(decode, room, session, host_pages, device_pages)

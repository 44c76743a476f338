"""What the refused-peer figures leave out: Mooncake's own work once a live peer's segment opens.

The send-path benchmarks (`bench.send_path`, `bench.slice_path`) call a
refusing peer, so each engine call stops at Mooncake's segment lookup, after
its binding has taken the descriptors: everything before that point is where
sglang's send and the hooked one differ. On a live peer Mooncake then builds
its transfer requests, submits them to its transport (both without the GIL)
and moves the bytes; that work is the same for both sends. This measures it
for one layer's call of the slice benchmark (65,536 descriptors of 512 bytes
at 32k tokens) to a live peer engine in another process over TCP:

- `submit`: the asynchronous arrays call (`batch_transfer_async_write_arrays`)
  until it returns a batch id: request building and the hand-over to the
  transport;
- `wire`: from then until the batch reports completion;
- `refused`: the same call's synchronous form to the refusing peer, as the
  send-path benchmarks make it.

Run: `python -m bench.live_submit [--descriptors 65536] [--repeats 3]`; prints JSON.
Needs Mooncake 0.3.14 (the arrays API).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import numpy as np

from bench.send_path import REFUSING_PEER
from gpu_planner.integration.mooncake.engine import (
    QUIET_ENV,
    engine_process,
    register_buffer,
    session_id,
    set_mooncake_defaults,
    start_engine,
)

LOCALHOST = "127.0.0.1"
DESCRIPTOR_BYTES = 512  # one token's head slice in the slice benchmark
COMPLETED = 0  # get_batch_transfer_status: 0 done, 1 pending, else failed
WAIT_LIMIT_S = 600.0


def _serve_peer(connection: Connection, nbytes: int) -> None:
    """The live peer: an engine with one registered buffer, kept until the pipe closes."""
    engine = start_engine(LOCALHOST)
    buffer = np.zeros(nbytes, dtype=np.uint8)
    register_buffer(engine, buffer.ctypes.data, buffer.nbytes)
    connection.send((session_id(engine, LOCALHOST), buffer.ctypes.data))
    with contextlib.suppress(EOFError):  # the benchmark closed the pipe: done
        connection.recv()


@contextlib.contextmanager
def live_peer(nbytes: int) -> Iterator[tuple[str, int]]:
    """A peer process with one registered buffer of `nbytes`: (its session, its address)."""
    connection, child_end = multiprocessing.Pipe()
    peer = engine_process(_serve_peer, (child_end, nbytes))
    peer.start()
    try:
        if not connection.poll(120):
            raise TimeoutError("the peer engine did not start in 120 s")
        yield connection.recv()
    finally:
        connection.close()
        peer.kill()
        peer.join()


def _wait_for(engine, batch_id: int) -> float:
    """Seconds until batch `batch_id` completes; raise if it fails or takes WAIT_LIMIT_S."""
    start = time.perf_counter()
    while (status := engine.get_batch_transfer_status([batch_id])) != COMPLETED:
        if status != 1:
            raise RuntimeError(f"batch {batch_id} failed with status {status}")
        if time.perf_counter() - start > WAIT_LIMIT_S:
            raise TimeoutError(f"batch {batch_id} still pending after {WAIT_LIMIT_S} s")
        time.sleep(1e-3)
    return time.perf_counter() - start


def measure(num_descriptors: int, repeats: int) -> dict[str, object]:
    """Median submit, wire and refused-call seconds of `repeats` calls of `num_descriptors`."""
    set_mooncake_defaults(QUIET_ENV)
    nbytes = 2 * num_descriptors * DESCRIPTOR_BYTES  # every other slot, as head slices are
    with live_peer(nbytes) as (peer_session, peer_ptr):
        engine = start_engine(LOCALHOST)
        source = np.ones(nbytes, dtype=np.uint8)
        register_buffer(engine, source.ctypes.data, source.nbytes)
        offsets = np.arange(num_descriptors, dtype=np.int64) * 2 * DESCRIPTOR_BYTES
        srcs, dsts = source.ctypes.data + offsets, peer_ptr + offsets
        lens = np.full(num_descriptors, DESCRIPTOR_BYTES, dtype=np.int64)
        engine.batch_transfer_sync_write_arrays(peer_session, srcs[:1], dsts[:1], lens[:1])
        samples: dict[str, list[float]] = {"submit": [], "wire": [], "refused": []}
        for _ in range(repeats):
            start = time.perf_counter()
            batch_id = engine.batch_transfer_async_write_arrays(peer_session, srcs, dsts, lens)
            samples["submit"].append(time.perf_counter() - start)
            if batch_id == 0:
                raise RuntimeError("the live peer refused the batch")
            samples["wire"].append(_wait_for(engine, batch_id))
            start = time.perf_counter()
            engine.batch_transfer_sync_write_arrays(REFUSING_PEER, srcs, dsts, lens)
            samples["refused"].append(time.perf_counter() - start)
    medians = {name: float(np.median(values)) for name, values in samples.items()}
    return {
        "descriptors": num_descriptors,
        "descriptor_bytes": DESCRIPTOR_BYTES,
        "repeats": repeats,
        **{f"{name}_s": value for name, value in medians.items()},
        "submit_ns_per_descriptor": medians["submit"] / num_descriptors * 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--descriptors", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(measure(args.descriptors, args.repeats), indent=1))


if __name__ == "__main__":
    main()

"""Mooncake transfer engine set-up: start, register buffers, name the local session.

Transport and metadata service are parameters: TCP with the P2P handshake (no
metadata server) is what the tests and the demo use on 127.0.0.1; production
runs RDMA with its own metadata service and NIC names.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator, Mapping
from multiprocessing import reduction

P2P_HANDSHAKE = "P2PHANDSHAKE"
# Mooncake's TCP transport (per-peer lanes, tcp_transport.cpp, 0.3.13 and 0.3.14) queues at
# most this many descriptors per peer, parks more (MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER) for
# at most MC_TCP_ADMISSION_TIMEOUT_MS (1 s) and fails the call for the rest; values that are
# not digits or lie outside [1, 65535] fall back to 1024.
TCP_QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
TCP_QUEUE_DEFAULT = 1024
TCP_QUEUE_MAX = 65535
# Mooncake's Python binding gives up on a batch (-1) after MC_TRANSFER_TIMEOUT seconds (at least
# 5; 30 when unset) plus a nanosecond per byte, while its TCP transport may still send it.
TRANSFER_TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"
TRANSFER_TIMEOUT_DEFAULT_S = 30
TRANSFER_TIMEOUT_MIN_S = 5
# Mooncake logs every connection and its missing RDMA devices: keep its errors only.
QUIET_ENV = {"MC_LOG_LEVEL": "ERROR"}
# sglang's `MooncakeTransferEngine` wrapper on a machine without RDMA: TCP only.
TCP_ONLY_ENV = {"MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1"}
# What a peer engine's process imports before it is forked (`engine_process`).
ENGINE_PROCESS_PRELOAD = ("gpu_planner.integration.mooncake.engine", "mooncake.engine")


def set_mooncake_defaults(*environments: Mapping[str, str]) -> None:
    """Set each of `environments`' Mooncake variables in `os.environ` where it is not set.

    The one place the project sets Mooncake's variables for the process (the
    demo, the benchmarks): an operator's own values win.
    """
    for environment in environments:
        for name, value in environment.items():
            os.environ.setdefault(name, value)


def tcp_queue_env(max_queued_transfers: int = TCP_QUEUE_MAX) -> dict[str, str]:
    """The environment that lets one TCP call queue `max_queued_transfers` descriptors per peer.

    Pass it to `start_engine(environment=...)`, or merge it into the
    environment of a subprocess that starts an engine. The default queue
    (1024) is smaller than sglang-sized batches (1024 pages x 61 buffers x runs).
    """
    return {TCP_QUEUE_ENV: str(max_queued_transfers)}


def transfer_timeout_s(environ: Mapping[str, str] = os.environ) -> int:
    """The seconds after which Mooncake's binding reports a write -1, parsed as it parses them
    (`atoi`: leading digits, else 0, then at least 5)."""
    text = environ.get(TRANSFER_TIMEOUT_ENV)
    if text is None:
        return TRANSFER_TIMEOUT_DEFAULT_S
    digits = text.strip()
    sign = -1 if digits.startswith("-") else 1
    digits = digits.lstrip("+-")
    leading = digits[: len(digits) - len(digits.lstrip("0123456789"))][:18]
    return max(TRANSFER_TIMEOUT_MIN_S, sign * int(leading or 0))


# Memory a Mooncake write that did not end cleanly read or wrote is not reused for this many
# transfer timeouts: the binding frees the batch at its -1, so nothing confirms the write's end.
STALLED_WRITE_TIMEOUTS = 4


def stalled_write_s(environ: Mapping[str, str] = os.environ) -> float:
    """How long memory a write that failed or timed out touched is held before its reuse."""
    return float(STALLED_WRITE_TIMEOUTS * transfer_timeout_s(environ))


def tcp_queue_capacity(environ: Mapping[str, str] = os.environ) -> int:
    """The per-peer TCP queue of an engine started with `environ`, parsed as Mooncake parses it."""
    text = environ.get(TCP_QUEUE_ENV, "")
    if text.isascii() and text.isdigit() and 1 <= int(text) <= TCP_QUEUE_MAX:
        return int(text)
    return TCP_QUEUE_DEFAULT


@contextlib.contextmanager
def set_environment(env: Mapping[str, str]) -> Iterator[None]:
    """Set `env` in `os.environ` for the block, then restore what was there."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_engine(
    local_hostname: str,
    *,
    metadata_server: str = P2P_HANDSHAKE,
    protocol: str = "tcp",
    device_name: str = "",
    environment: Mapping[str, str] | None = None,
):
    """A Mooncake `TransferEngine` initialised on `local_hostname`; raise when Mooncake refuses.

    `metadata_server` is Mooncake's metadata connection string (P2P handshake by
    default), `protocol` its transport ("tcp", "rdma"), `device_name` the RDMA
    NICs ("" lets Mooncake choose). `environment` holds Mooncake settings
    (`tcp_queue_env()`, for example), set in `os.environ` only while the engine
    initialises, which is when Mooncake reads them.
    """
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    with set_environment(environment or {}):
        status = engine.initialize(local_hostname, metadata_server, protocol, device_name)
    if status != 0:
        raise RuntimeError(
            f"Mooncake TransferEngine.initialize({local_hostname!r}, {metadata_server!r}, "
            f"{protocol!r}, {device_name!r}) returned {status}"
        )
    return engine


def register_buffer(engine, ptr: int, nbytes: int) -> None:
    """Register `nbytes` at `ptr` with `engine`; raise when Mooncake refuses."""
    status = engine.register_memory(ptr, nbytes)
    if status != 0:
        raise RuntimeError(f"Mooncake register_memory({ptr:#x}, {nbytes}) returned {status}")


def session_id(engine, local_hostname: str) -> str:
    """The peer name other engines use to reach `engine` (P2P handshake: host:rpc_port)."""
    return f"{local_hostname}:{engine.get_rpc_port()}"


def engine_process(target: Callable[..., None], args: tuple = ()) -> multiprocessing.Process:
    """An unstarted daemon process that runs `target(*args)` (a peer engine, for example).

    It is forked from multiprocessing's fork server, which imported gpu_planner
    and Mooncake once (`ENGINE_PROCESS_PRELOAD`): a spawned process imports them
    anew, about 3 s on two cores (mostly torch), for every peer. The server is
    a fresh interpreter started with the first such process (it ends with this
    one), so nothing of this process reaches the child but `args`, and what a
    spawned child would inherit as it is now: the environment, and the stdout
    and stderr file descriptors (a forked child would otherwise have the
    server's, as they were when the server started).
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(ENGINE_PROCESS_PRELOAD))  # read once: at server start
    inherited = (dict(os.environ), _InheritedFd(1), _InheritedFd(2))
    return context.Process(target=_run_inherited, args=(*inherited, target, args), daemon=True)


class _InheritedFd:
    """One of this process's file descriptors, duplicated into the child it is pickled for."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _detached, (reduction.DupFd(self.fd),)


def _detached(duplicate) -> int:
    return duplicate.detach()


def _run_inherited(
    environment: dict[str, str], stdout: int, stderr: int, target: Callable[..., None], args: tuple
) -> None:
    os.environ.clear()
    os.environ.update(environment)
    for inherited, fd in ((stdout, 1), (stderr, 2)):
        os.dup2(inherited, fd)
        os.close(inherited)
    target(*args)

"""Mooncake transfer engine set-up: start, register buffers, name the local session.

Transport and metadata service are parameters: TCP with the P2P handshake (no
metadata server) is what the tests and the demo use on 127.0.0.1; production
runs RDMA with its own metadata service and NIC names.
"""

from __future__ import annotations

import os

P2P_HANDSHAKE = "P2PHANDSHAKE"
TCP_QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
TCP_QUEUE_MAX = 65535  # Mooncake 0.3.13 ignores larger values


def tcp_queue_env(max_queued_transfers: int = TCP_QUEUE_MAX) -> dict[str, str]:
    """The environment that lets one TCP call hold `max_queued_transfers` descriptors per peer.

    Mooncake reads it when an engine starts; merge it into the environment of
    the process (or subprocess) that starts one. The default queue (about 2k)
    refuses sglang-sized batches (1024 pages x 61 buffers x runs).
    """
    return {TCP_QUEUE_ENV: str(max_queued_transfers)}


def start_engine(
    local_hostname: str,
    *,
    metadata_server: str = P2P_HANDSHAKE,
    protocol: str = "tcp",
    device_name: str = "",
):
    """A Mooncake `TransferEngine` initialised on `local_hostname`; raise when Mooncake refuses.

    `metadata_server` is Mooncake's metadata connection string (P2P handshake by
    default), `protocol` its transport ("tcp", "rdma"), `device_name` the RDMA
    NICs ("" lets Mooncake choose).
    """
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
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


def apply_environment(env: dict[str, str]) -> None:
    """Set `env` in this process unless already set (call before the engine starts)."""
    for name, value in env.items():
        os.environ.setdefault(name, value)

"""Mooncake: engine set-up and the submit loop that hands plans to the transfer engine."""

from gpu_planner.integration.mooncake.engine import register_buffer, session_id, start_engine
from gpu_planner.integration.mooncake.transfer import (
    MooncakeReader,
    MooncakeSender,
    MooncakeTransfer,
    TransferError,
    TransferTimeoutError,
)

__all__ = [
    "MooncakeReader",
    "MooncakeSender",
    "MooncakeTransfer",
    "TransferError",
    "TransferTimeoutError",
    "register_buffer",
    "session_id",
    "start_engine",
]

"""Fixtures shared by the sglang integration tests that move bytes through real engines."""

from __future__ import annotations

import warnings

import pytest


@pytest.fixture(scope="module")
def engines():
    """(prefill engine, decode engine): sglang's Mooncake wrapper, TCP on 127.0.0.1."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            MooncakeTransferEngine,
        )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MOONCAKE_PROTOCOL", "tcp")
        env.setenv("MC_FORCE_TCP", "1")
        yield MooncakeTransferEngine("127.0.0.1"), MooncakeTransferEngine("127.0.0.1")

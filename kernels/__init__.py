"""Triton kernels of gpu_planner, one concern per module (imported lazily: they import triton)."""

import os


def interpreter_enabled() -> bool:
    """True when Triton runs kernels on CPU tensors (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

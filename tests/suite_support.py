"""Plain helpers the test modules import (`from suite_support import ...`).

Not in conftest.py: the suite has more than one conftest module, and a test
module's `from suite_support import` would get whichever was imported last.
"""

from __future__ import annotations

import pytest
import torch

from gpu_planner import settings
from gpu_planner.kernels import interpreter_enabled

ON_CUDA = torch.cuda.is_available() and not interpreter_enabled()


def list_batches(plan) -> list[tuple[list[int], list[int], list[int]]]:
    """`plan`'s calls as Mooncake's list API takes them: (srcs, dsts, lens) per non-empty batch."""
    return [piece[2:] for piece in plan.pieces(lists=True)]


def set_knob(monkeypatch: pytest.MonkeyPatch, name: str, value: str | None) -> None:
    """Set (None: unset) a gpu_planner variable for this test; the next `loaded` sees it."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    settings.forget_loaded()

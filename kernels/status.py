"""Device-side status words: the first error positions found by the kernels.

Kernels record errors with atomic-min into these slots instead of reading
anything back; the host reads the whole word once, when the plan is materialised.
"""

import torch

NO_ERROR = 2**63 - 1
NEGATIVE_SRC = 0  # first negative page position: src, then host dst (+1), device dst (+2)
OUT_OF_BOUNDS = 3  # (buffer * capacity + run) * 2 + (0 dst | 1 src), first in that order
NUM_SLOTS = 4


def new_status(device: torch.device) -> torch.Tensor:
    return torch.full((NUM_SLOTS,), NO_ERROR, dtype=torch.int64, device=device)

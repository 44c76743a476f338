"""AROUND hook for sglang's `kv_to_page_indices` (`sglang.srt.mem_cache.common`).

sglang computes `(kv[::page_size] // page_size).cpu().numpy()`: a strided
slice, a division kernel and a pageable device-to-host copy. For CUDA tensors
the hook converts with gpu_planner's kernel and copies the pages once through
gpu_planner's pinned staging; the result is the same NumPy array (it keeps its
pinned block until it is freed). Anything else runs the original.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

import gpu_planner as gp
from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.integration.sglang.fallback import Fallback
from gpu_planner.pinned_copies import copy_to_host


@dataclasses.dataclass
class PagesCall:
    """The arguments of `kv_to_page_indices` (sglang 0.5.23), bound like the original."""

    kv_indices: torch.Tensor
    page_size: int


def kv_to_page_indices_hook(*args, **kwargs) -> np.ndarray:
    """sglang's page indices of `kv_indices`, converted on the GPU for CUDA tensors."""
    call = PagesCall(*args, **kwargs)
    kv_indices = call.kv_indices
    if not (
        isinstance(kv_indices, torch.Tensor) and cuda_runtime().runs_on_device(kv_indices.device)
    ):
        raise Fallback("kv_to_page_indices of indices not on a CUDA device", key="pages on host")
    try:
        pages = gp.kv_to_page_indices(kv_indices, call.page_size)
    except gp.PlanValidationError as error:
        raise Fallback(f"kv_to_page_indices input not supported ({error})", key="pages") from None
    return copy_to_host(pages).numpy()

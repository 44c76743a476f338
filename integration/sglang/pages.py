"""AROUND hook for sglang's `kv_to_page_indices` (`sglang.srt.mem_cache.common`).

sglang computes `(kv[::page_size] // page_size).cpu().numpy()`: a strided
slice, a division kernel and a pageable device-to-host copy. For CUDA tensors
the hook converts with gpu_planner's kernel and copies the pages once through
gpu_planner's pinned staging; the result is the same NumPy array (it keeps its
pinned block until it is freed). Anything else runs the original.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np
import torch

import gpu_planner as gp
from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.integration.sglang.fallback import log_fallback_once
from gpu_planner.staging import copy_to_host

# The original's parameters, as the plugin's register() compares them.
HOOKED_PARAMETERS = (
    ("kv_indices", inspect.Parameter.empty),
    ("page_size", inspect.Parameter.empty),
)


def kv_to_page_indices_hook(
    original: Callable[[torch.Tensor, int], np.ndarray], kv_indices: torch.Tensor, page_size: int
) -> np.ndarray:
    """sglang's page indices of `kv_indices`, converted on the GPU for CUDA tensors."""
    on_device = isinstance(kv_indices, torch.Tensor) and cuda_runtime().runs_on_device(
        kv_indices.device
    )
    if not on_device:
        return original(kv_indices, page_size)
    try:
        pages = gp.kv_to_page_indices(kv_indices, page_size)
    except gp.PlanValidationError as error:
        log_fallback_once(f"kv_to_page_indices input not supported ({error})", key="pages")
        return original(kv_indices, page_size)
    return copy_to_host(pages).numpy()

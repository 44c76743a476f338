"""gpu_planner: KV-transfer planning for prefill/decode disaggregated serving.

Token slots -> page indices -> contiguous runs (host and device destination
spaces) -> `(src_addr, dst_addr, length)` descriptors per KV buffer, as Triton
kernels on the GPU that holds the indices, or compiled (Numba) loops on the CPU.
"""

from gpu_planner import reference
from gpu_planner.errors import BoundsError, PlanValidationError
from gpu_planner.layout import BufferLayout
from gpu_planner.pages import PageIndices, kv_to_page_indices, page_indices
from gpu_planner.pending import PendingPageIndices, page_indices_async
from gpu_planner.plan import PlanPiece, TransferPlan, plan_transfer
from gpu_planner.runs import Runs, SpaceRuns, group_runs
from gpu_planner.warmup import warmup

__all__ = [
    "BoundsError",
    "BufferLayout",
    "PageIndices",
    "PendingPageIndices",
    "PlanPiece",
    "PlanValidationError",
    "SpaceRuns",
    "Runs",
    "TransferPlan",
    "group_runs",
    "kv_to_page_indices",
    "page_indices",
    "page_indices_async",
    "plan_transfer",
    "reference",
    "warmup",
]

"""Input normalisation and validation shared by every planner entry point."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from gpu_planner.errors import PlanValidationError

Backend = Literal["cpu", "triton"]
IndexLike = torch.Tensor | np.ndarray

PageList = torch.Tensor | np.ndarray  # validated: a NumPy array for data in host memory

_INDEX_DTYPES = (torch.int32, torch.int64)
_INDEX_ARRAY_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
HOST = torch.device("cpu")


def as_page_list(values: IndexLike, name: str) -> PageList:
    """A 1-D int32/int64 page list: NumPy for host data (a CPU tensor is viewed), else the tensor.

    Host data is checked with NumPy alone: a NumPy page list never calls into
    torch on the CPU path, and a CPU tensor only once, to be viewed.
    """
    if isinstance(values, torch.Tensor) and values.device == HOST:
        try:
            values = values.numpy()
        except (TypeError, RuntimeError):  # no NumPy dtype (bfloat16) or requires grad
            return _checked_tensor(values, name)
    if isinstance(values, np.ndarray):
        return _checked_array(values, name)
    if not isinstance(values, torch.Tensor):
        raise PlanValidationError(
            f"{name}: expected a torch tensor or NumPy array, got {type(values).__name__}"
        )
    return _checked_tensor(values, name)


def _checked_array(values: np.ndarray, name: str) -> np.ndarray:
    if values.dtype.kind not in "iu":
        raise PlanValidationError(f"{name}: expected an integer array, got dtype {values.dtype}")
    if values.ndim != 1:
        raise PlanValidationError(f"{name}: expected a 1-D tensor, got shape {values.shape}")
    if values.dtype not in _INDEX_ARRAY_DTYPES:
        values = values.astype(np.int64)
    return values


def _checked_tensor(values: torch.Tensor, name: str) -> torch.Tensor:
    if values.dim() != 1:
        raise PlanValidationError(f"{name}: expected a 1-D tensor, got shape {tuple(values.shape)}")
    if values.dtype not in _INDEX_DTYPES:
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise PlanValidationError(f"{name}: expected an integer tensor, got {values.dtype}")
        values = values.to(torch.int64)
    return values


def as_tensor(pages: PageList) -> torch.Tensor:
    """The page list as a torch tensor (host arrays are shared, or copied if read-only)."""
    if isinstance(pages, torch.Tensor):
        return pages
    return torch.from_numpy(pages if pages.flags.writeable else pages.copy())


def as_host_array(pages: PageList) -> np.ndarray:
    """The page list as a NumPy array in host memory (device tensors are copied back)."""
    return pages if isinstance(pages, np.ndarray) else pages.cpu().numpy()


def as_index_tensor(values: IndexLike, name: str) -> torch.Tensor:
    """Return `values` as a 1-D int32/int64 torch tensor on its own device (no copy if possible)."""
    return as_tensor(as_page_list(values, name))


def check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise PlanValidationError(f"page_size: must be an int >= 1, got {page_size!r}")


def check_max_batch_pages(max_batch_pages: int) -> None:
    if not isinstance(max_batch_pages, int) or max_batch_pages < 0:
        raise PlanValidationError(
            f"max_batch_pages: must be an int >= 0 (0 = no cut), got {max_batch_pages!r}"
        )


def check_same_length(first: PageList, first_name: str, other: PageList, name: str) -> None:
    if len(other) != len(first):
        raise PlanValidationError(
            f"{name}: has {len(other)} pages but {first_name} has {len(first)}; "
            "page lists are transferred pairwise and must have equal lengths"
        )


def check_same_device(page_lists: dict[str, PageList]) -> torch.device:
    devices = {
        name: HOST if isinstance(pages, np.ndarray) else pages.device
        for name, pages in page_lists.items()
    }
    first_name, device = next(iter(devices.items()))
    for name, other in devices.items():
        if other != device:
            raise PlanValidationError(
                f"{name}: is on {other} but {first_name} is on {device}; "
                "all page lists must be on one device"
            )
    return device


PAGE_ARGUMENTS = ("src_pages", "dst_pages", "dst_device_pages")


def collect_pages(
    src_pages: IndexLike, dst_pages: IndexLike, dst_device_pages: IndexLike | None
) -> tuple[dict[str, PageList], torch.device]:
    """Validated page lists by argument name (equal lengths, one device)."""
    pages = {"src_pages": as_page_list(src_pages, "src_pages")}
    pages["dst_pages"] = as_page_list(dst_pages, "dst_pages")
    if dst_device_pages is not None:
        pages["dst_device_pages"] = as_page_list(dst_device_pages, "dst_device_pages")
    for name in PAGE_ARGUMENTS[1:]:
        if name in pages:
            check_same_length(pages["src_pages"], "src_pages", pages[name], name)
    return pages, check_same_device(pages)


def negative_page_error(name: str, position: int, value: int | None = None) -> PlanValidationError:
    shown = "" if value is None else f" = {value}"
    return PlanValidationError(f"{name}[{position}]{shown}: page indices must be >= 0")


def raise_recorded_negative_page(status: np.ndarray) -> None:
    """Raise for the first negative page the kernels recorded in the status word."""
    from gpu_planner.kernels.status import NO_ERROR

    for slot, name in enumerate(PAGE_ARGUMENTS):
        if status[slot] != NO_ERROR:
            raise negative_page_error(name, int(status[slot]))


def resolve_backend(backend: Backend | None, device: torch.device) -> Backend:
    """Auto: Triton on CUDA tensors, the vectorised CPU backend on CPU tensors."""
    if backend is None:
        return "triton" if device.type == "cuda" else "cpu"
    if backend not in ("cpu", "triton"):
        raise PlanValidationError(f"backend: must be None, 'cpu' or 'triton', got {backend!r}")
    if backend == "triton" and device.type != "cuda":
        from gpu_planner.kernels import interpreter_enabled

        if not interpreter_enabled():
            raise PlanValidationError(
                "backend='triton' on CPU tensors needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 before triton is imported"
            )
    return backend

"""Input normalisation and validation shared by every planner entry point."""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
import torch

from gpu_planner.errors import PlanValidationError
from gpu_planner.status import NEGATIVE_PAGE_SLOTS, recorded_negative_page

Backend = Literal["cpu", "triton"]
IndexLike = torch.Tensor | np.ndarray

PageList = torch.Tensor | np.ndarray  # validated: a NumPy array for data in host memory

_INDEX_DTYPES = (torch.int32, torch.int64)
_INDEX_ARRAY_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
HOST = torch.device("cpu")
INT64_MAX = 2**63 - 1  # the largest page, pointer, length or byte address


def shown_int(value: int) -> int | str:
    """`value` as an error message shows it: in hex from 2**128 on, where a decimal of over
    4,300 digits would make the message itself raise (Python's int-to-str limit)."""
    return value if abs(value) < 2**128 else f"{value:#x}"


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
        if values.dtype == np.uint64:
            _check_fits_int64(np.flatnonzero(values > INT64_MAX), values, name)
        values = values.astype(np.int64)
    return values


def _check_fits_int64(too_large: np.ndarray, values: np.ndarray, name: str) -> None:
    """Refuse unsigned 64-bit pages >= 2**63 (int64 would show them as negative)."""
    if too_large.size:
        position = int(too_large[0])
        raise PlanValidationError(
            f"{name}[{position}] = {int(values[position])}: page indices must be "
            "< 2**63 (they do not fit in int64)"
        )


def _checked_tensor(values: torch.Tensor, name: str) -> torch.Tensor:
    if values.dim() != 1:
        raise PlanValidationError(f"{name}: expected a 1-D tensor, got shape {tuple(values.shape)}")
    if values.dtype not in _INDEX_DTYPES:
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise PlanValidationError(f"{name}: expected an integer tensor, got {values.dtype}")
        if values.dtype == torch.uint64:  # few uint64 kernels exist: compare its int64 view
            signed = values.view(torch.int64)
            _check_fits_int64(
                torch.nonzero(signed < 0).flatten().cpu().numpy(), values.cpu().numpy(), name
            )
            return signed
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


def is_integer(value: object) -> bool:
    """A Python or NumPy integer, not a bool (True is no page count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_page_size(page_size: int) -> int:
    """`page_size` as a Python int; refuse anything but an integer in [1, 2**63 - 1].

    Slots are int64, so a larger page size fits no kernel argument and holds
    no slot but slot 0's page.
    """
    if not is_integer(page_size) or not 1 <= page_size <= INT64_MAX:
        raise PlanValidationError(
            f"page_size: must be an integer >= 1 and <= 2**63 - 1, got {page_size!r}"
        )
    return int(page_size)


def check_max_batch_pages(max_batch_pages: int) -> int:
    """`max_batch_pages` as a Python int; refuse anything but an integer >= 0."""
    if not is_integer(max_batch_pages) or max_batch_pages < 0:
        raise PlanValidationError(
            f"max_batch_pages: must be an integer >= 0 (0 = no cut), got {max_batch_pages!r}"
        )
    return int(max_batch_pages)


def check_same_length(first: PageList, first_name: str, other: PageList, name: str) -> None:
    if len(other) != len(first):
        raise PlanValidationError(
            f"{name}: has {len(other)} pages but {first_name} has {len(first)}; "
            "page lists are transferred pairwise and must have equal lengths"
        )


def check_same_torch_device(page_lists: dict[str, PageList]) -> torch.device:
    """The one torch device of `page_lists` (NumPy arrays are on the host)."""
    if all([isinstance(pages, np.ndarray) for pages in page_lists.values()]):
        return HOST  # the CPU send path's case, without a device comparison per list
    torch_devices = {
        name: HOST if isinstance(pages, np.ndarray) else pages.device
        for name, pages in page_lists.items()
    }
    first_name, torch_device = next(iter(torch_devices.items()))
    for name, other in torch_devices.items():
        if other != torch_device:
            raise PlanValidationError(
                f"{name}: is on {other} but {first_name} is on {torch_device}; "
                "all page lists must be on one torch device"
            )
    return torch_device


def batch_page_count(num_pages: int, max_batch_pages: int) -> int:
    """Pages per batch: the cut size, or all pages when batching is off (a Python int)."""
    return int(max_batch_pages) if 0 < max_batch_pages < num_pages else max(num_pages, 1)


PAGE_ARGUMENTS = tuple(NEGATIVE_PAGE_SLOTS)  # src_pages, dst_pages, dst_device_pages


class PageRequest(NamedTuple):
    """One plan's validated page lists, where they live and how they are cut into batches."""

    pages: dict[str, PageList]  # by argument name: src_pages, dst_pages[, dst_device_pages]
    torch_device: torch.device
    batch_pages: int  # pages per batch (all pages when not cut)

    @property
    def num_pages(self) -> int:
        return len(self.pages["src_pages"])

    @property
    def num_batches(self) -> int:
        return -(-self.num_pages // self.batch_pages)


def collect_pages(
    src_pages: IndexLike,
    dst_pages: IndexLike,
    dst_device_pages: IndexLike | None,
    max_batch_pages: int = 0,
) -> PageRequest:
    """Validated page lists by argument name (equal lengths, one torch device) and batch cut."""
    max_batch_pages = check_max_batch_pages(max_batch_pages)
    given = [src_pages, dst_pages] + ([] if dst_device_pages is None else [dst_device_pages])
    if all([_is_host_index_array(values) for values in given]):
        # The CPU send path's case (sglang's NumPy page lists): nothing to view or convert.
        pages = dict(zip(PAGE_ARGUMENTS, given, strict=False))
        torch_device = HOST
    else:
        pages = {
            name: as_page_list(values, name)
            for name, values in zip(PAGE_ARGUMENTS, given, strict=False)
        }
        torch_device = None
    num_pages = len(pages["src_pages"])
    for name, values in pages.items():
        if len(values) != num_pages:
            check_same_length(pages["src_pages"], "src_pages", values, name)
    if torch_device is None:
        torch_device = check_same_torch_device(pages)
    return PageRequest(pages, torch_device, batch_page_count(num_pages, max_batch_pages))


def _is_host_index_array(values: IndexLike) -> bool:
    """A 1-D int32/int64 NumPy array: a page list as it is (`as_page_list` returns it)."""
    return type(values) is np.ndarray and values.ndim == 1 and values.dtype in _INDEX_ARRAY_DTYPES


def negative_page_error(name: str, position: int, value: int | None = None) -> PlanValidationError:
    shown = "" if value is None else f" = {value}"
    return PlanValidationError(f"{name}[{position}]{shown}: page indices must be >= 0")


def raise_recorded_negative_page(status: np.ndarray, pages: np.ndarray | None = None) -> None:
    """Raise for the first negative page recorded in the status word (host copy).

    `pages`, the page lists stacked in argument order, adds the page's value.
    """
    recorded = recorded_negative_page(status)
    if recorded is not None:
        name, position = recorded
        value = None if pages is None else int(pages[NEGATIVE_PAGE_SLOTS[name], position])
        raise negative_page_error(name, position, value)


def resolve_backend(backend: Backend | None, torch_device: torch.device) -> Backend:
    """Auto: Triton on CUDA tensors, the compiled CPU backend on CPU tensors."""
    if backend is None:
        # `HOST` (NumPy page lists) by identity: reading a device's type is a call into torch,
        # tens of us right after a transfer left the caches cold.
        return "cpu" if torch_device is HOST or torch_device.type != "cuda" else "triton"
    if backend not in ("cpu", "triton"):
        raise PlanValidationError(f"backend: must be None, 'cpu' or 'triton', got {backend!r}")
    if backend == "triton" and torch_device.type != "cuda":
        from gpu_planner.kernels import interpreter_enabled

        if not interpreter_enabled():
            raise PlanValidationError(
                "backend='triton' on CPU tensors needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 before triton is imported"
            )
    return backend

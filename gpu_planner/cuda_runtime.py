"""The CUDA runtime calls the planner's host logic makes, behind one small seam.

Around its kernels the planner keeps host-side state on CUDA: pinned staging
blocks and their lifetimes, events, side streams, device guards, the status
read. That logic runs only where tensors live on a CUDA device, so a machine
without a GPU would never run it. Every such call goes through the process's
`CudaRuntime` (`cuda_runtime()`); the test suite swaps in a host stand-in
(`use_cuda_runtime`) under which CPU tensors take the CUDA path, so the same
orchestration runs, line for line, in the CPU suite.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

HOST = torch.device("cpu")
_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CU_MEMORYTYPE_DEVICE = 2


class CudaRuntime:
    """torch's CUDA runtime: the real calls, one method each."""

    def __init__(self) -> None:
        self._side_streams: dict[torch.device, Any] = {}
        self._side_streams_lock = threading.Lock()
        self._per_thread = threading.local()  # each thread's DeviceContext per torch device
        self._workspace_pools: dict[int, Any] = {}

    def device_context(self, torch_device: torch.device) -> DeviceContext:
        """The calling thread's `DeviceContext` of `torch_device` (resolved once per thread).

        sglang's transfer threads never select a device, so a plan takes its
        device from its tensors; resolving it (and its side stream) once per
        thread keeps torch's device guards and index lookups off every call.
        """
        contexts = self._per_thread.__dict__.setdefault("contexts", {})
        context = contexts.get(torch_device)
        if context is None:
            index = torch_device.index
            if index is None:
                index = self.current_device() if torch_device.type == "cuda" else 0
            context = DeviceContext(self, index, torch_device)
            contexts[torch_device] = context
        return context

    def exchange_device(self, index: int) -> int:
        """Make device `index` current in this thread; return the previous one (no lookup)."""
        return torch._C._cuda_exchangeDevice(index)

    def restore_device(self, previous: int) -> None:
        torch._C._cuda_maybeExchangeDevice(previous)

    def launch_stream(self, index: int) -> int | None:
        """The raw handle of device `index`'s current stream, for cached kernel launches."""
        return torch._C._cuda_getCurrentRawStream(index)

    def runs_on_device(self, torch_device: torch.device) -> bool:
        """Whether tensors on `torch_device` take the CUDA path (staging, events, streams)."""
        return torch_device.type == "cuda"

    def device_guard(self, torch_device: torch.device) -> contextlib.AbstractContextManager:
        return torch.cuda.device(torch_device)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_stream(self, torch_device: torch.device | None = None) -> Any:
        return torch.cuda.current_stream(torch_device)

    def stream_guard(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def is_capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (no events may be recorded)."""
        return torch.cuda.is_current_stream_capturing()

    def copy_async(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Queue `target.copy_(source)` on the current stream; the host does not wait."""
        target.copy_(source, non_blocking=True)

    def host_register(self, address: int, nbytes: int) -> int:
        """Page-lock host memory for every device (`cudaHostRegisterPortable`); the CUDA error.

        A failure is also cleared from the thread's last CUDA error, so that
        torch does not report it as the error of the caller's next kernel.
        """
        portable = 1
        error = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, portable))
        if error != 0:
            _clear_last_error()
        return error

    def host_unregister(self, address: int) -> int:
        return int(torch.cuda.cudart().cudaHostUnregister(address))

    def memory_device(self, address: int) -> torch.device:
        """The device whose memory holds `address`: `cuda:N` for device memory, else the host.

        Asked of the CUDA driver (`cuPointerGetAttribute`), so it holds whatever
        device the calling thread has selected.
        """
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return HOST
        if _pointer_attribute(address, _CU_POINTER_ATTRIBUTE_MEMORY_TYPE) != _CU_MEMORYTYPE_DEVICE:
            return HOST
        ordinal = _pointer_attribute(address, _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
        return HOST if ordinal is None else torch.device("cuda", ordinal)

    def empty_bytes(self, nbytes: int, torch_device: torch.device) -> torch.Tensor:
        """`nbytes` uninitialised bytes on `torch_device` (a uint8 tensor)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=torch_device)

    def side_stream(self, torch_device: torch.device) -> Any:
        """This process's side stream on `torch_device` (made once), for reading finished work."""
        with self._side_streams_lock:
            if torch_device not in self._side_streams:
                self._side_streams[torch_device] = self._new_stream(torch_device)
            return self._side_streams[torch_device]

    def _new_stream(self, torch_device: torch.device) -> Any:
        return torch.cuda.Stream(device=torch_device)

    def workspace_pool(self, index: int) -> Any:
        """This process's pool of plan workspaces on CUDA device `index` (made once)."""
        from gpu_planner.workspaces import WorkspacePool

        with self._side_streams_lock:
            if index not in self._workspace_pools:
                cuda = torch.device("cuda", index)
                self._workspace_pools[index] = WorkspacePool(
                    lambda nbytes: self.empty_bytes(nbytes, cuda)
                )
            return self._workspace_pools[index]


class DeviceContext:
    """One thread's view of one CUDA device: its index and the process's side stream there.

    `with context:` makes the device current for the block (two C calls, no
    index lookup), as the compiled kernels, allocations and copies need.
    """

    def __init__(self, runtime: CudaRuntime, index: int, torch_device: torch.device) -> None:
        self.runtime = runtime
        self.index = index
        self.torch_device = torch_device
        self._side_stream: Any = None
        self._previous: list[int] = []
        self.workspaces = runtime.workspace_pool(index)

    @property
    def side_stream(self) -> Any:
        if self._side_stream is None:
            self._side_stream = self.runtime.side_stream(torch.device("cuda", self.index))
        return self._side_stream

    def __enter__(self) -> DeviceContext:
        self._previous.append(self.runtime.exchange_device(self.index))
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.runtime.restore_device(self._previous.pop())


@functools.cache
def _cuda_driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@functools.cache
def _cuda_runtime_library() -> ctypes.CDLL | None:
    """The CUDA runtime torch loaded (found by its soname), or None."""
    major = (torch.version.cuda or "").split(".")[0]
    try:
        return ctypes.CDLL(f"libcudart.so.{major}")
    except OSError:
        return None


def _clear_last_error() -> None:
    """Reset the calling thread's last CUDA runtime error (`cudaGetLastError`)."""
    runtime_library = _cuda_runtime_library()
    if runtime_library is not None:
        runtime_library.cudaGetLastError()


def _pointer_attribute(address: int, attribute: int) -> int | None:
    """One `cuPointerGetAttribute` value of `address` (an int-sized one), or None on any error."""
    driver = _cuda_driver()
    if driver is None:
        return None
    value = ctypes.c_int()
    result = driver.cuPointerGetAttribute(
        ctypes.byref(value), ctypes.c_int(attribute), ctypes.c_uint64(address)
    )
    return value.value if result == 0 else None


_runtime = CudaRuntime()


def cuda_runtime() -> CudaRuntime:
    """The runtime the planner's CUDA host logic calls (torch's, unless a test swapped it)."""
    return _runtime


@contextlib.contextmanager
def use_cuda_runtime(runtime: CudaRuntime) -> Iterator[CudaRuntime]:
    """Run the planner's CUDA host logic through `runtime` (a test stand-in) within the block."""
    global _runtime
    previous, _runtime = _runtime, runtime
    try:
        yield runtime
    finally:
        _runtime = previous

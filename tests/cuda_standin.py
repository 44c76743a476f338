"""A host stand-in for the CUDA runtime calls of the planner's host logic.

`HostCudaRuntime` replaces `gpu_planner.cuda_runtime.CudaRuntime` (through
`use_cuda_runtime`): CPU tensors then take the CUDA path, so the real pinned
staging, plan materialisation, `page_indices_async` and the sglang page hook
run on a machine without a GPU. It keeps what makes that logic hard to get
right on a device: a copy queued on a stream runs only when an event after it
is waited for (a result read before its event is seen unwritten), streams and
the current device are per thread (a new thread starts on device 0, as in
CUDA), memory can stand for a given device's (`place`, `memory_device`),
pinning is bookkept (unpinning what was never pinned fails), and after every
wait `after_wait` runs: the `host_cuda` fixture overwrites there every block
the staging pool would hand out next, as another thread's copy could at that
moment. Kernels run at once (the Triton interpreter or the CPU path), as if
the device were infinitely fast, so only the copies are deferred.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator

import torch

from gpu_planner.block_pool import BlockPool
from gpu_planner.cuda_runtime import CudaRuntime


class HostStream:
    """A stream: copies queued in order, run when waited for."""

    def __init__(self) -> None:
        self._pending: deque[Callable[[], None]] = deque()
        self._queued = 0
        self._completed = 0
        self._lock = threading.Lock()

    def enqueue(self, work: Callable[[], None]) -> None:
        with self._lock:
            self._pending.append(work)
            self._queued += 1

    def position(self) -> int:
        """How many operations were queued so far (what an event recorded now waits for)."""
        with self._lock:
            return self._queued

    def run_until(self, position: int) -> None:
        """Run queued operations, in order, until the first `position` have completed."""
        with self._lock:
            while self._completed < position:
                self._pending.popleft()()
                self._completed += 1

    def done_until(self, position: int) -> bool:
        with self._lock:
            return self._completed >= position

    def synchronize(self) -> None:
        self.run_until(self.position())

    def wait_event(self, event: HostEvent) -> None:
        """Order later work after `event`: here, complete what it marks now (no host wait)."""
        event.synchronize(host_wait=False)

    def wait_stream(self, stream: HostStream) -> None:
        stream.synchronize()


class HostEvent:
    """An event: marks a stream's position when recorded; completes when that work has run."""

    def __init__(self, runtime: HostCudaRuntime) -> None:
        self._runtime = runtime
        self._stream: HostStream | None = None
        self._position = 0

    def record(self, stream: HostStream | None = None) -> None:
        self._stream = self._runtime.current_stream() if stream is None else stream
        self._position = self._stream.position()

    def query(self) -> bool:
        """Whether the marked work has run (never runs it: only a wait does)."""
        return self._stream is None or self._stream.done_until(self._position)

    def synchronize(self, host_wait: bool = True) -> None:
        self._runtime.host_waits += host_wait
        if self._stream is not None:
            self._stream.run_until(self._position)
        self._runtime.after_wait()


class HostCudaRuntime(CudaRuntime):
    """The CUDA runtime on the host: CPU tensors stand for device tensors."""

    def __init__(self, after_wait: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.after_wait = after_wait
        self._thread = threading.local()
        self._default_stream = HostStream()
        self.pinned: dict[int, int] = {}  # address -> bytes, of every block pinned now
        self.copies = 0  # copies queued so far
        self.placements: list[tuple[int, int, int]] = []  # (start, end, device) of `place`
        self.allocations: list[tuple[torch.device, int]] = []  # (device, current device) made
        self.device_lookups = 0  # device guards entered and current devices asked for
        self.host_waits = 0  # event or stream synchronisations
        self._pinned_lock = threading.Lock()

    def runs_on_device(self, torch_device: torch.device) -> bool:
        return torch_device.type in ("cpu", "cuda")

    @contextlib.contextmanager
    def device_guard(self, torch_device: torch.device | int) -> Iterator[None]:
        index = torch_device if isinstance(torch_device, int) else (torch_device.index or 0)
        previous = self.current_device()
        self._thread.device = index
        try:
            yield
        finally:
            self._thread.device = previous

    def current_device(self) -> int:
        self.device_lookups += 1
        return getattr(self._thread, "device", 0)

    def exchange_device(self, index: int) -> int:
        previous = getattr(self._thread, "device", 0)
        self._thread.device = index
        return previous

    def restore_device(self, previous: int) -> None:
        self._thread.device = previous

    def launch_stream(self, index: int) -> None:
        """No raw stream: kernels launch through the JIT (the interpreter has no compiled ones)."""
        return None

    def current_stream(self, torch_device: torch.device | None = None) -> HostStream:
        return getattr(self._thread, "stream", None) or self._default_stream

    @contextlib.contextmanager
    def stream_guard(self, stream: HostStream) -> Iterator[None]:
        previous = getattr(self._thread, "stream", None)
        self._thread.stream = stream
        try:
            yield
        finally:
            self._thread.stream = previous

    def new_event(self) -> HostEvent:
        return HostEvent(self)

    def is_capturing(self) -> bool:
        return False

    def copy_async(self, target: torch.Tensor, source: torch.Tensor) -> None:
        self.copies += 1
        self.current_stream().enqueue(lambda: target.copy_(source))

    def host_register(self, address: int, nbytes: int) -> int:
        with self._pinned_lock:
            assert address not in self.pinned, f"{address:#x} pinned twice"
            self.pinned[address] = nbytes
        return 0

    def host_unregister(self, address: int) -> int:
        with self._pinned_lock:
            assert self.pinned.pop(address, None) is not None, f"{address:#x} was not pinned"
        return 0

    def _new_stream(self, torch_device: torch.device) -> HostStream:
        return HostStream()

    def place(self, tensor: torch.Tensor, index: int) -> None:
        """Let `tensor`'s bytes stand for memory of CUDA device `index` (`memory_device`)."""
        start = tensor.data_ptr()
        self.placements.append((start, start + tensor.numel() * tensor.element_size(), index))

    def memory_device(self, address: int) -> torch.device:
        """`cuda:N` for bytes `place`d on device N; host memory otherwise."""
        for start, end, index in self.placements:
            if start <= address < end:
                return torch.device("cuda", index)
        return torch.device("cpu")

    def empty_bytes(self, nbytes: int, torch_device: torch.device) -> torch.Tensor:
        """Host bytes standing for `torch_device`'s; records (device, current device) made."""
        region = torch.empty(nbytes, dtype=torch.uint8)
        if torch_device.type == "cuda":
            self.place(region, torch_device.index or 0)
        self.allocations.append((torch_device, self.current_device()))
        return region


def scribble_free_blocks(pool: BlockPool) -> Callable[[], None]:
    """Overwrite every free block of `pool` with zeros, as the next copies may.

    Zeros read as "no error" in a status word and as page 0, so a result still
    viewing a block the pool counts as free is seen changed (or its error lost).
    """

    def scribble() -> None:
        pool.retained_bytes  # noqa: B018 (takes the blocks returned so far in)
        with pool._lock:  # no block can be taken, and so written, meanwhile
            for block in pool._free:
                block.array[:] = 0

    return scribble


@contextlib.contextmanager
def one_kernel_at_a_time() -> Iterator[None]:
    """Serialise Triton interpreter launches, as one device runs them; the interpreter
    keeps per-launch state in globals and is not safe for concurrent launches."""
    from triton.runtime.interpreter import GridExecutor

    launch = GridExecutor.__call__
    device = threading.Lock()

    def launch_alone(self, *args, **kwargs):
        with device:
            return launch(self, *args, **kwargs)

    GridExecutor.__call__ = launch_alone
    try:
        yield
    finally:
        GridExecutor.__call__ = launch

"""CPU SCAFFOLDING, not product code: a sglang plugin for sglang 0.5.23's servers on a CPU.

Found by sglang's `load_plugins()` through the entry point in the
`sglang_cpu_scaffolding-0.dist-info` folder next to it (the launcher,
`bench.servers.launcher`, puts this folder on every server's PYTHONPATH;
nothing is installed). Without CUDA it does two things:

- sglang 0.5.23's prefill, for every send whose sender has
  `supports_host_tensor_indices` (`MooncakeKVSender` has, as on a GPU),
  divides the pages on the device, copies them into pinned memory and records
  a `torch.cuda.Event` that the transfer worker waits on. On a CPU the prefill
  module sees a torch whose pinned host tensors are plain host tensors and
  whose CUDA events are complete at once (the copy into them is synchronous
  there), so the servers take the path a CUDA prefill takes, not the
  `kv_to_page_indices` one.
- sglang 0.5.23's `init_model_parallel_group` turns on pynccl for TP > 1 (it
  only spares NPU, XPU and out-of-tree platforms), whose communicator fails on
  a CPU device. An AROUND hook passes `use_pynccl=False`, so TP groups use
  torch.distributed (gloo) alone.

With CUDA it does nothing. The e2e suite's test-only controls (corruption,
skipped scatter, stall) are in `tests/e2e/scaffolding/`, not here.
"""

from __future__ import annotations

MODEL_PARALLEL_GROUP = "sglang.srt.distributed.parallel_state.init_model_parallel_group"


def register() -> None:
    """The `sglang.srt.plugins` entry point: patch what sglang's CPU path needs."""
    import torch
    from sglang.srt.disaggregation import prefill
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not torch.cuda.is_available():
        prefill.torch = HostTorch(torch)
        HookRegistry.register(MODEL_PARALLEL_GROUP, without_pynccl, HookType.AROUND)


class HostEvent:
    """A CUDA event on a CPU: the work before it ran when it was recorded."""

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class HostCuda:
    """`torch.cuda` for sglang's prefill module on a CPU: events complete at once, no stream."""

    Event = HostEvent

    def __init__(self, cuda: object) -> None:
        self._cuda = cuda

    def current_stream(self, device: object = None) -> None:
        return None

    def __getattr__(self, name: str) -> object:
        return getattr(self._cuda, name)


class HostTorch:
    """`torch` for sglang's prefill module on a CPU: pinned host tensors are plain host tensors
    (pinning needs a CUDA driver), `cuda` is `HostCuda`; everything else is torch's own."""

    def __init__(self, torch: object) -> None:
        self._torch = torch
        self.cuda = HostCuda(torch.cuda)

    def empty(self, *args: object, pin_memory: bool = False, **kwargs: object) -> object:
        return self._torch.empty(*args, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self._torch, name)


def without_pynccl(original, *args, **kwargs):
    """sglang's TP group constructor with pynccl off (a CPU machine has no NCCL device)."""
    return original(*args, **{**kwargs, "use_pynccl": False})

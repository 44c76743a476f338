"""CPU SCAFFOLDING, not product code: a sglang plugin for sglang 0.5.23's servers on a CPU.

Found by sglang's `load_plugins()` through the entry point in the
`sglang_cpu_scaffolding-0.dist-info` folder next to it (the launcher,
`bench.servers.launcher`, puts this folder on every server's PYTHONPATH;
nothing is installed). Without CUDA it does two things:

- sglang 0.5.23's prefill allocates pinned memory and records a
  `torch.cuda.Event` for every send whose sender has
  `supports_host_tensor_indices` (`MooncakeKVSender` has). Setting it to False
  makes sglang take its CPU `kv_to_page_indices` path instead.
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
    from sglang.srt.disaggregation.mooncake import conn
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not torch.cuda.is_available():
        conn.MooncakeKVSender.supports_host_tensor_indices = False
        HookRegistry.register(MODEL_PARALLEL_GROUP, without_pynccl, HookType.AROUND)


def without_pynccl(original, *args, **kwargs):
    """sglang's TP group constructor with pynccl off (a CPU machine has no NCCL device)."""
    return original(*args, **{**kwargs, "use_pynccl": False})

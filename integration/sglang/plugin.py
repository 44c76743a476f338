"""sglang plugin: plan sglang's Mooncake KV transfers with gpu_planner.

sglang's `load_plugins()` calls `register` through the `sglang.srt.plugins`
entry point named `gpu_planner`. It registers AROUND hooks on
`MooncakeKVManager._send_kvcache_generic`, the head-sliced sends
(`send_kvcache_slice`, `_send_swa_state_slice`) and `kv_to_page_indices` with
sglang's `HookRegistry`, after checking that each target still has the
signature of sglang 0.5.23 that the hooks mirror. `GPU_PLANNER_DISABLE=1`
turns the plugin off. With the page hook it also registers an AFTER hook on
`MooncakeKVManager.__init__` that compiles the Triton kernels (`gp.warmup`)
on the process's GPU, off the request path. Registering never touches CUDA:
plugins load before sglang selects each rank's GPU, so a CUDA call here would
create a context on GPU 0 in every rank.
"""

from __future__ import annotations

import inspect
import logging
import os
import pkgutil
from collections.abc import Callable

from gpu_planner import cpu_backend, head_slices
from gpu_planner.integration.sglang.fallback import log_fallback_once

logger = logging.getLogger(__name__)

SEND_TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._send_kvcache_generic"
SLICE_TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache_slice"
SWA_SLICE_TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._send_swa_state_slice"
PAGES_TARGET = "sglang.srt.mem_cache.common.kv_to_page_indices"
WARMUP_TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.__init__"

Parameters = tuple[tuple[str, object], ...]


def plugin_disabled() -> bool:
    """True when GPU_PLANNER_DISABLE asks for sglang's own code."""
    return os.environ.get("GPU_PLANNER_DISABLE", "").strip().lower() in ("1", "true", "yes")


def register() -> None:
    """Register gpu_planner's hooks with sglang (the `sglang.srt.plugins` entry point)."""
    if plugin_disabled():
        logger.info("gpu_planner: GPU_PLANNER_DISABLE is set; sglang plans its own transfers")
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        hooks = hook_targets()
    except ImportError as error:
        log_fallback_once(f"sglang's Mooncake connector does not import ({error})")
        return
    for target, (hook, expected) in hooks.items():
        mismatch = target_mismatch(target, expected)
        if mismatch is not None:
            log_fallback_once(mismatch)
            continue
        HookRegistry.register(target, hook, HookType.AROUND)
        if target == SEND_TARGET:  # sends plan on the CPU backend: compile before the first
            cpu_backend.compile_kernels()
        if target in (SLICE_TARGET, SWA_SLICE_TARGET):
            head_slices.compile_kernels()
        if target == PAGES_TARGET:  # pages convert on the GPU: compile once it is selected
            HookRegistry.register(WARMUP_TARGET, warm_up_after_manager_init, HookType.AFTER)


def warm_up_after_manager_init(result: None, *args: object, **kwargs: object) -> None:
    """AFTER sglang builds its Mooncake KV manager: compile the kernels on this process's GPU.

    sglang builds the manager in the scheduler process after it selected the
    process's GPU and before it serves a request. A process that never
    initialised CUDA has no GPU work for the planner and is left alone.
    """
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    from gpu_planner import warmup

    try:
        warmup(torch.device("cuda", torch.cuda.current_device()))
    except Exception as error:  # a failed warm-up must not stop sglang: kernels compile later
        log_fallback_once(f"kernel warm-up failed ({error}); kernels compile on first use")
    return None


def hook_targets() -> dict[str, tuple[Callable, Parameters]]:
    """Each hooked target: (hook, the target parameters it mirrors). ImportError without sglang."""
    # Imported here: these pull in sglang's Mooncake connector, which only
    # sglang processes (not `import gpu_planner`) should pay for.
    from gpu_planner.integration.sglang import pages as sglang_pages
    from gpu_planner.integration.sglang import send as sglang_send
    from gpu_planner.integration.sglang import send_slice

    return {
        SEND_TARGET: (sglang_send.send_kvcache_generic_hook, sglang_send.HOOKED_PARAMETERS),
        SLICE_TARGET: (send_slice.send_kvcache_slice_hook, send_slice.SLICE_PARAMETERS),
        SWA_SLICE_TARGET: (send_slice.send_swa_state_slice_hook, send_slice.SWA_SLICE_PARAMETERS),
        PAGES_TARGET: (sglang_pages.kv_to_page_indices_hook, sglang_pages.HOOKED_PARAMETERS),
    }


def target_mismatch(target: str, expected: Parameters) -> str | None:
    """Why the hook on `target` would not register in this sglang (missing or changed), or None."""
    try:
        found = function_parameters(pkgutil.resolve_name(target))
    except (ImportError, AttributeError) as error:
        return f"{target} is not in this sglang ({error})"
    if found != expected:
        return f"{target} has parameters {found}, not the {expected} of sglang 0.5.23"
    return None


def function_parameters(function: Callable) -> Parameters:
    """(name, default) of each parameter; `inspect.Parameter.empty` marks no default."""
    return tuple(
        (name, parameter.default)
        for name, parameter in inspect.signature(function).parameters.items()
    )

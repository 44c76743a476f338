"""The plugin warms the kernels up on the process's GPU after sglang selected it, never before."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict

import pytest
import torch
from suite_support import ON_CUDA

from gpu_planner.integration.sglang import fallback as sglang_fallback
from gpu_planner.integration.sglang import plugin as sglang_plugin
from gpu_planner.integration.sglang.plugin import WARMUP_TARGET, warm_up_after_manager_init

NO_CUDA_INIT = """
import torch

def refuse(*args, **kwargs):
    raise AssertionError("CUDA was initialised")

torch.cuda._lazy_init = refuse
{body}
print("CUDA untouched")
"""


def run_without_cuda_init(body: str) -> subprocess.CompletedProcess:
    """Run `body` in a fresh process where initialising CUDA raises."""
    return subprocess.run(
        [sys.executable, "-c", NO_CUDA_INIT.format(body=body)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_registering_never_touches_cuda():
    result = run_without_cuda_init(
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "from gpu_planner.integration.sglang.plugin import WARMUP_TARGET, register\n"
        "register()\n"
        "assert WARMUP_TARGET in HookRegistry._hooks, dict(HookRegistry._hooks)"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CUDA untouched" in result.stdout


def test_the_warmup_runs_after_the_kv_manager_is_built(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(sglang_fallback, "_logged_keys", set())
    monkeypatch.delenv("GPU_PLANNER_DISABLE", raising=False)
    sglang_plugin.register()
    [(hook_type, hook, _)] = HookRegistry._hooks[WARMUP_TARGET]
    assert (hook_type, hook) == (HookType.AFTER, warm_up_after_manager_init)


def test_a_process_without_cuda_is_left_alone():
    result = run_without_cuda_init(
        "from gpu_planner.integration.sglang.plugin import warm_up_after_manager_init\n"
        "assert warm_up_after_manager_init(None, object()) is None"
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.skipif(not ON_CUDA, reason="no CUDA device (tests/kernels compiles the warm-up)")
def test_the_warmup_compiles_on_the_selected_cuda_device():
    from gpu_planner.kernels.page_indices import _page_indices_kernel

    selected = torch.cuda.device_count() - 1
    with torch.cuda.device(selected):  # what sglang selects before building the manager
        assert warm_up_after_manager_init(None, object()) is None
    kernel_cache = _page_indices_kernel.device_caches[selected][0]
    assert len(kernel_cache) == 6

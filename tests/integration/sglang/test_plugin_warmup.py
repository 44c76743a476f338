"""The plugin compiles what its hooks run after sglang built a KV manager (the scheduler), never
at registration: the CPU loops, and the kernels on the process's GPU once sglang selected it."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
from collections import defaultdict

import pytest
import torch
from suite_support import ON_CUDA

from gpu_planner import cpu_backend, head_scatter, head_slices
from gpu_planner.integration.sglang import fallback as sglang_fallback
from gpu_planner.integration.sglang import plugin as sglang_plugin
from gpu_planner.integration.sglang.plugin import (
    WARMUP_TARGET,
    compile_after_manager_init,
    warm_up_gpu,
)

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


def test_registering_touches_neither_cuda_nor_numba():
    """sglang's tokenizer and detokenizer processes load the plugin too: registering compiles
    nothing and never touches CUDA; the compile after the scheduler's manager compiles the CPU
    loops."""
    result = run_without_cuda_init(
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "from gpu_planner import cpu_backend\n"
        "from gpu_planner.integration.sglang.plugin import (\n"
        "    WARMUP_TARGET, compile_after_manager_init, register)\n"
        "register()\n"
        "assert WARMUP_TARGET in HookRegistry._hooks, dict(HookRegistry._hooks)\n"
        "assert not cpu_backend._scan_pages.signatures, cpu_backend._scan_pages.signatures\n"
        "compile_after_manager_init(None, object())\n"
        "assert cpu_backend._scan_pages.signatures and cpu_backend._expand.signatures"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CUDA untouched" in result.stdout


def test_what_the_hooks_run_compiles_once_after_the_kv_manager_is_built(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(sglang_fallback, "_logged_keys", set())
    monkeypatch.delenv("GPU_PLANNER_DISABLE", raising=False)
    compiled = []
    records = sglang_plugin.hook_records()
    monkeypatch.setattr(
        sglang_plugin,
        "hook_records",
        lambda: [
            record
            if record.compile is None
            else dataclasses.replace(
                record, compile=functools.partial(compiled.append, record.compile)
            )
            for record in records
        ],
    )
    sglang_plugin.register()
    [(hook_type, hook, _)] = HookRegistry._hooks[WARMUP_TARGET]
    assert (hook_type, hook) == (HookType.AFTER, compile_after_manager_init)
    assert compiled == []  # registering compiles nothing: most of sglang's processes never send
    assert compile_after_manager_init(None, object()) is None
    assert compile_after_manager_init(None, object()) is None  # a second manager: nothing more
    assert sorted(compiled, key=repr) == sorted(
        [cpu_backend.compile_kernels, head_slices.compile_kernels, head_slices.compile_kernels,
         warm_up_gpu, head_scatter.compile_kernels],
        key=repr,
    )  # fmt: skip


def test_a_process_without_cuda_is_left_alone():
    result = run_without_cuda_init(
        "from gpu_planner.integration.sglang.plugin import warm_up_gpu\n"
        "assert warm_up_gpu() is None"
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.skipif(not ON_CUDA, reason="no CUDA device (tests/kernels compiles the warm-up)")
def test_the_warmup_compiles_on_the_selected_cuda_device():
    from gpu_planner.kernels.page_indices import _page_indices_kernel

    selected = torch.cuda.device_count() - 1
    with torch.cuda.device(selected):  # what sglang selects before building the manager
        assert warm_up_gpu() is None
    kernel_cache = _page_indices_kernel.device_caches[selected][0]
    assert len(kernel_cache) == 6

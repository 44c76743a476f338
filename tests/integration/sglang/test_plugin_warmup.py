"""The plugin compiles what its hooks run after sglang built a KV manager (the scheduler), never
at registration: the CPU loops, and the kernels on the process's GPU once sglang selected it."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from suite_support import ON_CUDA, set_knob

from gpu_planner import cpu_backend, head_scatter, head_slices, settings
from gpu_planner.integration.sglang import fallback as sglang_fallback
from gpu_planner.integration.sglang import (
    page_sizes,
    pages,
    receive_staging,
    send_slots,
    staging_warmup,
)
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
    hooks = [(hook_type, hook) for hook_type, hook, _ in HookRegistry._hooks[WARMUP_TARGET]]
    # The CPU loops once per process; the GPU's kernels per manager (each its KV geometry);
    # each prefill manager's page size (`page_sizes`).
    assert hooks == [
        (HookType.AFTER, compile_after_manager_init),
        (HookType.AFTER, warm_up_gpu),
        (HookType.AFTER, page_sizes.manager_built_hook),
    ]
    assert compiled == []  # registering compiles nothing: most of sglang's processes never send
    assert compile_after_manager_init(None, object()) is None
    assert compile_after_manager_init(None, object()) is None  # a second manager: nothing more
    assert sorted(compiled, key=repr) == sorted(
        [cpu_backend.compile_kernels, head_slices.compile_kernels, head_slices.compile_kernels,
         head_scatter.compile_kernels, pages.choose_page_path],
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


def manager(mode: str, item_lens: list[int], page_size: int, kv_heads: int, **fields):
    """A manager as the staging warm-up reads it: its role and `kv_args`' KV geometry."""
    kv_args = SimpleNamespace(
        kv_data_ptrs=[4096 * (buffer + 1) for buffer in range(len(item_lens))],
        kv_item_lens=item_lens,
        page_size=page_size,
        kv_head_num=kv_heads,
    )
    return SimpleNamespace(
        disaggregation_mode=SimpleNamespace(name=mode), kv_args=kv_args, **fields
    )


@pytest.fixture
def staging_on(monkeypatch):
    """Send slots and receive staging on (the suite turns the gathered path off)."""
    for knob in (settings.GATHER_STAGING_BYTES, settings.RECEIVE_STAGING_BYTES):
        set_knob(monkeypatch, knob.name, str(1 << 20))


def test_the_staging_copies_follow_the_managers_role_geometry_and_knobs(monkeypatch, staging_on):
    prefill = manager("PREFILL", [4 * 2 * 256] * 4, page_size=4, kv_heads=2)
    staged, sliced = staging_warmup.manager_copies(prefill)
    assert (staged.scatter, staged.page_size, set(staged.slice_lens)) == (False, 1, {2048})
    assert (sliced.page_size, sliced.slice_lens) == (4, (256, 512))  # 1 or 2 of its heads
    mla = manager("PREFILL", [4 * 1152] * 4, page_size=4, kv_heads=1, is_mla_backend=True)
    assert [copies.page_size for copies in staging_warmup.manager_copies(mla)] == [1]
    decode = manager("DECODE", [4 * 2 * 256] * 4, page_size=4, kv_heads=2)
    one, two = staging_warmup.manager_copies(decode)  # one writer per slot, or two
    assert (one.scatter, one.slice_lens, two.slice_lens) == (True, (512,) * 4, (256,) * 4)
    assert two.staging_step == 4 * 2048 // 2  # a writer's part steps by its share of a page
    assert staging_warmup.manager_copies(manager("DECODE", [16], 4, 1, enable_staging=True)) == []
    set_knob(monkeypatch, settings.GATHER_STAGING_BYTES.name, "0")
    set_knob(monkeypatch, settings.RECEIVE_STAGING_BYTES.name, "0")
    assert staging_warmup.manager_copies(prefill) == staging_warmup.manager_copies(decode) == []


def test_slots_and_parts_start_as_aligned_as_the_warmup_assumes():
    assert send_slots.SLOT_ALIGNMENT % 16 == 0 and receive_staging.ALIGNMENT % 16 == 0


def test_the_staging_warmup_compiles_on_the_kvs_gpu_only(host_cuda, monkeypatch, staging_on):
    """Host KV: nothing to launch; KV on a (stand-in) GPU: each variant launched there."""
    from gpu_planner.kernels import head_gather, head_scatter

    launched = []
    for module, name in ((head_gather, "launch_gather_head_slices"),
                         (head_scatter, "launch_scatter_head_slices")):  # fmt: skip
        monkeypatch.setattr(module, name, lambda staging, *_, name=name: launched.append(name))
    kv = torch.zeros(4 * 4096, dtype=torch.uint8)
    prefill = manager("PREFILL", [2048] * 4, page_size=4, kv_heads=2)
    prefill.kv_args.kv_data_ptrs = [kv.data_ptr() + 4096 * buffer for buffer in range(4)]
    assert staging_warmup.warm_up_staging(prefill) == 0 and launched == []
    host_cuda.place(kv, 0)
    warmed = staging_warmup.warm_up_staging(prefill)
    assert warmed == len(launched) > 0 and set(launched) == {"launch_gather_head_slices"}


def test_a_failed_staging_warmup_is_logged_not_raised(monkeypatch, staging_on):
    monkeypatch.setattr(sglang_fallback, "_logged_keys", set())
    broken = SimpleNamespace(disaggregation_mode=SimpleNamespace(name="DECODE"))  # no kv_args
    assert warm_up_gpu(None, broken) is None
    assert "compile" in sglang_fallback._logged_keys

"""Compile every kernel variant for an H200 (sm_90) without a GPU; prove plans compile no more.

Triton's JIT runs for real against a stand-in driver that reports an sm_90
target and loads and launches nothing. `warm_up_kernels` (what `gp.warmup`
runs) then compiles each variant through Triton's CUDA pipeline down to a
cubin, which catches typing and lowering errors the interpreter lets
through, into the JIT's own per-device cache. Next the launchers run for
every page count, buffer count, batch cut, page dtype and view kind of the
sweep below: a launch whose specialisation key warm-up did not compile
compiles here, and is counted. The head-slice gathers and scatters go the
same way: warm-up compiles what the sglang plugin derives from each server
geometry of `SERVERS` (`staging_warmup`), then the public gather and scatter
run every path's layouts (staged whole pages, TP-up head slices, each
writer's share) over page counts, chunks, page dtypes and views, and the
staging offsets slots and receive parts take. A control kernel without
`do_not_specialize` shows the count does see specialisation. Run with
TRITON_INTERPRET unset; prints one JSON line.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

H200 = GPUTarget("cuda", 90, 32)
CPU = torch.device("cpu")
PAGE_COUNTS = (1, 2, 16, 17, 1024, 2048, 4099, 2**20)
BUFFER_COUNTS = (1, 16, 61)
MAX_BATCH_PAGES = (0, 16, 1000)


class _Sm90Utils:
    @staticmethod
    def get_device_properties(device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132}

    @staticmethod
    def load_binary(name, kernel, shared, device):
        return 1, 1, 0, 0, 1024  # module, function, registers, spills, max threads

    @staticmethod
    def unload_module(module):
        pass


class Sm90Driver:
    """Triton driver stand-in: device 0 is an sm_90; kernels load and launch as no-ops."""

    utils = _Sm90Utils()

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return H200

    def launcher_cls(self, src, metadata):
        return lambda *args: None


compiled: list[tuple[str, str]] = []


def script_report(script: Path, *args: str) -> dict:
    """Run `script` with the interpreter off; the JSON of its last line of output.

    The limit is generous: a compile shares the cores with whatever else runs.
    """
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=1800
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def counting_compile(original):
    def do_compile(self, key, *args, **kwargs):
        kernel = original(self, key, *args, **kwargs)
        assert kernel.asm["cubin"], f"{self._fn_name}: no cubin"
        compiled.append((self._fn_name, key))
        return kernel

    return do_compile


def page_views(num_pages: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """The same page count as a contiguous tensor, an offset view and a strided view."""
    base = torch.randperm(2 * num_pages + 3, generator=torch.Generator().manual_seed(seed))
    base = base.to(dtype)
    return [base[:num_pages].clone(), base[1 : num_pages + 1], base[3::2][:num_pages]]


def sweep_plans() -> int:
    """Launch the planner's kernels for every case of the sweep; return the launches."""
    from gpu_planner.inputs import collect_pages
    from gpu_planner.kernels.expand_descriptors import launch_expand_descriptors
    from gpu_planner.layout import BufferLayout
    from gpu_planner.runs import launch_runs

    launches = 0
    dtypes = (torch.int32, torch.int64)
    for num_pages, num_buffers in itertools.product(PAGE_COUNTS, BUFFER_COUNTS):
        is_device = [buffer % 2 == 1 for buffer in range(num_buffers)]
        layout = BufferLayout(
            [1 << 20] * num_buffers, [1 << 30] * num_buffers, [4096] * num_buffers, is_device
        )
        tables = layout.tables(CPU)
        for max_batch_pages, (src_dtype, dst_dtype, device_dtype), view in itertools.product(
            MAX_BATCH_PAGES, itertools.product(dtypes, repeat=3), range(3)
        ):
            src = page_views(num_pages, src_dtype, 1)[view]
            dst = page_views(num_pages, dst_dtype, 2)[view]
            dst_device = page_views(num_pages, device_dtype, 3)[view] if any(is_device) else None
            request = collect_pages(src, dst, dst_device, max_batch_pages)
            runs = launch_runs(request.pages, request.batch_pages)
            launch_expand_descriptors(
                tables,
                layout.num_host_buffers,
                layout.num_device_buffers,
                runs,
                [1] * runs.num_spaces,  # the key cannot depend on counts: any value serves
            )
            launches += 4
    return launches


def sweep_page_indices() -> int:
    from gpu_planner.kernels.page_indices import launch_page_indices

    launches = 0
    for tokens, page_size, (row_dtype, host_dtype) in itertools.product(
        (1, 17, 4099, 1 << 20), (1, 16, 64), itertools.product((torch.int32, torch.int64), repeat=2)
    ):
        req_to_token = torch.arange(3 * (tokens + 5), dtype=row_dtype).view(3, -1)
        row = req_to_token[1]  # a row view at an offset, as sglang passes it
        host_slots = torch.arange(tokens + 7, dtype=host_dtype)[7:]
        for start, host in ((0, host_slots), (tokens // 3, None)):
            launch_page_indices(host, row, start, tokens, page_size)
            launches += 1
    return launches


@dataclass(frozen=True)
class Server:
    """A server's KV geometry, as its Mooncake KV manager's `kv_args` give it."""

    ptrs: list[int]
    item_lens: list[int]
    page_size: int
    kv_heads: int
    mla: bool = False


def _ptrs(count: int, offset: int = 0) -> list[int]:
    """Buffer addresses far from any host allocation (the launches read nothing)."""
    return [(1 << 40) + buffer * (1 << 30) + offset for buffer in range(count)]


SERVERS = (
    Server(_ptrs(8), [16 * 8 * 256] * 8, page_size=16, kv_heads=8),  # MHA: 8 heads of 128 bf16
    Server(_ptrs(4), [64 * 1152] * 4, page_size=64, kv_heads=1, mla=True),  # MLA: 576 bf16
    # Odd: 8-byte aligned buffers of two widths, page size 1, 2 heads of 36 bytes (or 20).
    Server(_ptrs(6, offset=8), [72] * 4 + [40] * 2, page_size=1, kv_heads=2),
)
SLICE_PAGE_COUNTS = (1, 3, 17)
POOL_PAGES = 64  # each buffer's registered pages
SLOT_BYTES = 8 << 20  # a send slot (a multiple of their 256-byte alignment): 17 pages fit


def warm_up_servers() -> int:
    """What the plugin's warm-up compiles for each server, as a prefill and as a decode."""
    from gpu_planner.integration.sglang.staging_warmup import decode_copies, prefill_copies
    from gpu_planner.warmup import warm_up_slice_copies

    launches = 0
    for server in SERVERS:
        geometry = (server.ptrs, server.item_lens, server.page_size, server.kv_heads)
        copies = prefill_copies(*geometry, server.mla) + decode_copies(*geometry)
        launches += warm_up_slice_copies(CPU, copies)
    return launches


def sweep_gathers(server: Server, slots: torch.Tensor) -> int:
    """The prefill's gathers into a slot: staged whole pages, and TP-up head slices."""
    from gpu_planner.head_gather import chunk_layout, gather_head_slices
    from gpu_planner.head_slices import HeadSliceLayout

    entries = len(server.ptrs)
    layouts = [  # staged: whole source pages of every buffer, as `staged_send` lays them out
        HeadSliceLayout.build(
            src_ptrs=server.ptrs, dst_ptrs=[0] * entries, page_size=1,
            src_page_lens=server.item_lens, dst_page_lens=server.item_lens,
            src_token_lens=server.item_lens, dst_token_lens=server.item_lens,
            src_head_offsets=0, dst_head_offsets=0, slice_lens=server.item_lens,
        )
    ]  # fmt: skip
    token_len = server.item_lens[0] // server.page_size
    head_len = token_len // server.kv_heads
    if not server.mla and len(set(server.item_lens)) == 1:
        for heads, shift in itertools.product(range(1, server.kv_heads + 1), (0, 1)):
            first = min(shift, server.kv_heads - heads)  # the decode rank's first head
            layout = HeadSliceLayout.build(
                src_ptrs=server.ptrs, dst_ptrs=_ptrs(entries, 1 << 29),
                page_size=server.page_size, src_page_lens=server.item_lens,
                dst_page_lens=server.page_size * heads * head_len, src_token_lens=token_len,
                dst_token_lens=heads * head_len, src_head_offsets=first * head_len,
                dst_head_offsets=0, slice_lens=heads * head_len,
            )  # fmt: skip
            # Chunks of whole entries (`gathered.plan_chunks`): all, one, a few.
            layouts += [chunk_layout(layout, part) for part in (slice(None), [0], [1, 2])]
    launches = 0
    for layout, num_pages, dtype, view, slot in itertools.product(
        layouts, SLICE_PAGE_COUNTS, (torch.int32, torch.int64), range(3), range(2)
    ):
        pages = page_views(num_pages, dtype, num_pages)[view]  # pages < 2 * 17 + 3
        staging = slots[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES]
        gather_head_slices(layout, pages, staging, POOL_PAGES * server.item_lens[0], "triton")
        launches += 1
    return launches


def sweep_scatters(server: Server, region: torch.Tensor) -> int:
    """The decode's scatters of each writer's chunks, from where its part of a reservation puts
    them, into host pages and, for HiSparse, device pages too."""
    from gpu_planner.head_scatter import scatter_head_slices, scatter_layout
    from gpu_planner.integration.sglang.staging_wire import chunk_offset, writer_part

    page_bytes = sum(server.item_lens)
    launches = 0
    for writers in range(1, server.kv_heads + 1):
        unit = server.page_size * writers
        if server.kv_heads % writers or any(length % unit for length in server.item_lens):
            continue
        for writer, num_pages, start, reservation, hisparse in itertools.product(
            range(writers), SLICE_PAGE_COUNTS, (0, 1, 5), (0, 256 * 3), (False, True)
        ):
            nbytes = (start + num_pages + 2) * page_bytes  # the reservation's pages
            base = reservation + writer_part(nbytes, writers, writer)[0]
            base += chunk_offset(page_bytes, writers, start)
            layout = scatter_layout(
                server.ptrs, server.item_lens, server.page_size, writers, writer,
                num_pages=num_pages,
            )  # fmt: skip
            pages = np.arange(num_pages, dtype=np.int64) * 2
            is_device = [hisparse and entry % 2 == 1 for entry in range(len(server.ptrs))]
            scatter_head_slices(
                layout, pages, region[base:], POOL_PAGES * max(server.item_lens),
                dst_device_pages=pages + 1 if hisparse else None, dst_is_device=is_device,
                backend="triton",
            )  # fmt: skip
            launches += 1
    return launches


def sweep_slice_copies() -> int:
    """Every server's gathers and scatters (CPU tensors stand for the device's: the launches
    go through Triton's JIT to the stand-in driver, which runs nothing)."""
    import gpu_planner.kernels

    gpu_planner.kernels.interpreter_enabled = lambda: True  # lets backend="triton" take them
    slots = torch.empty(2 * SLOT_BYTES, dtype=torch.uint8)
    region = torch.empty(16 << 20, dtype=torch.uint8)  # the last writer's 17 pages fit
    return sum(sweep_gathers(server, slots) + sweep_scatters(server, region) for server in SERVERS)


def specialising_control() -> int:
    """New compiles of the count kernel, jitted without `do_not_specialize`, over page counts."""
    from gpu_planner.kernels import run_scan
    from gpu_planner.runs import launch_runs

    plain = triton.jit(run_scan._count_runs_kernel.fn)
    original, run_scan._count_runs_kernel = run_scan._count_runs_kernel, plain
    before = len(compiled)
    try:
        for num_pages in (16, 17):
            pages = torch.arange(num_pages, dtype=torch.int64)
            launch_runs({"src_pages": pages, "dst_pages": pages}, batch_pages=num_pages)
    finally:
        run_scan._count_runs_kernel = original
    return len(compiled) - before


def main() -> int:
    driver.set_active(Sm90Driver())
    JITFunction._do_compile = counting_compile(JITFunction._do_compile)
    from gpu_planner.warmup import warm_up_kernels

    warmup_launches = warm_up_kernels(CPU) + warm_up_servers()
    variants = sorted({name for name, _ in compiled})
    per_kernel = {name: sum(1 for kernel, _ in compiled if kernel == name) for name in variants}
    warmed = len(compiled)
    plan_launches = sweep_plans() + sweep_page_indices() + sweep_slice_copies()
    new_after_warmup = compiled[warmed:]
    control = specialising_control()
    print(
        json.dumps(
            {
                "warmup_launches": warmup_launches,
                "compiled_variants": warmed,
                "per_kernel": per_kernel,
                "swept_launches": plan_launches,
                "new_after_warmup": [name for name, _ in new_after_warmup],
                "control_new_compiles": control,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile every planner kernel ahead of time for an H200 (sm_90) without a GPU.

The interpreter checks semantics on CPU but not typing or lowering; this
compiles each kernel variant the launchers use through Triton's real
CUDA pipeline down to PTX and cubin. Run with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import itertools
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gpu_planner.kernels import expand_descriptors, page_indices, run_scan

H200 = GPUTarget("cuda", 90, 64)


def compile_kernel(kernel, signature: dict[str, str], constexprs: dict[str, object]) -> int:
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=H200)
    return len(compiled.asm["cubin"])


def page_pointer_variants():
    return itertools.product(["*i32", "*i64"], repeat=2)


def main() -> int:
    count = 0
    for device_type, host_type in page_pointer_variants():
        for has_host in (True, False):
            signature = {
                "device_slots_ptr": device_type,
                "device_slots_stride": "i64",
                "host_slots_ptr": host_type,
                "host_slots_stride": "i64",
                "device_pages_ptr": device_type,
                "host_pages_ptr": host_type,
                "start_token": "i64",
                "num_pages": "i32",
                "page_size": "i32",
            }
            compile_kernel(
                page_indices._page_indices_kernel, signature, {"HAS_HOST": has_host, "BLOCK": 1024}
            )
            count += 1
    for src_type, dst_type in page_pointer_variants():
        pages = {
            "src_ptr": src_type,
            "src_stride": "i64",
            "host_dst_ptr": dst_type,
            "host_dst_stride": "i64",
            "device_dst_ptr": dst_type,
            "device_dst_stride": "i64",
        }
        for has_device in (True, False):
            constexprs = {"HAS_DEVICE": has_device, "BLOCK": run_scan.BLOCK_PAGES}
            compile_kernel(
                run_scan._count_runs_kernel,
                {
                    **pages,
                    "block_counts_ptr": "*i64",
                    "first_negative_ptr": "*i64",
                    "num_pages": "i32",
                    "num_blocks": "i32",
                    "batch_pages": "i32",
                },
                constexprs,
            )
            compile_kernel(
                run_scan._scatter_runs_kernel,
                {
                    **pages,
                    "block_offsets_ptr": "*i64",
                    "page_starts_ptr": "*i64",
                    "page_ends_ptr": "*i64",
                    "src_starts_ptr": "*i64",
                    "dst_starts_ptr": "*i64",
                    "batch_run_offsets_ptr": "*i64",
                    "num_pages": "i32",
                    "num_blocks": "i32",
                    "capacity": "i32",
                    "num_batches": "i32",
                    "batch_pages": "i32",
                },
                constexprs,
            )
            count += 2
    compile_kernel(
        run_scan._scan_block_counts_kernel,
        {
            "block_counts_ptr": "*i64",
            "block_offsets_ptr": "*i64",
            "batch_run_offsets_ptr": "*i64",
            "num_blocks": "i32",
            "num_batches": "i32",
        },
        {"BLOCK": run_scan.BLOCK_SCAN},
    )
    count += 1
    tables = [
        "space_ptr",
        "host_before_ptr",
        "device_before_ptr",
        "src_ptrs_ptr",
        "dst_ptrs_ptr",
        "item_lens_ptr",
        "src_lens_ptr",
        "dst_lens_ptr",
        "page_starts_ptr",
        "page_ends_ptr",
        "src_starts_ptr",
        "dst_starts_ptr",
        "batch_run_offsets_ptr",
        "descriptors_ptr",
        "first_out_of_bounds_ptr",
    ]
    scalars = ["capacity", "num_batches", "batch_pages", "num_host_buffers", "num_device_buffers"]
    for has_device, check_bounds in itertools.product((True, False), repeat=2):
        compile_kernel(
            expand_descriptors._expand_descriptors_kernel,
            {**{name: "*i64" for name in tables}, **{name: "i32" for name in scalars}},
            {
                "HAS_DEVICE": has_device,
                "CHECK_BOUNDS": check_bounds,
                "BLOCK": expand_descriptors.BLOCK_RUNS,
            },
        )
        count += 1
    print(f"compiled {count} kernel variants for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())

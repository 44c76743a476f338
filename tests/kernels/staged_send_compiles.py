"""Staged sends after the plugin's warm-up, with every Triton compile counted (sm_90 stand-in).

The staged sends of `test_receive_staging_mooncake` (two real Mooncake
engines over TCP, real managers, the plugin's hooks), with both sides' KV
standing for a GPU's through the CUDA stand-in (tests/cuda_standin.py): the
prefill gathers into device slots, the decode scatters from a device region.
The interpreter is off: Triton's JIT compiles each gather and scatter for the
sm_90 of `aot_compile` (which loads and launches nothing, so the bytes are not
checked here; the interpreted test checks them) and each compile is counted.
`plugin.warm_up_gpu` runs for each manager first, as sglang's AFTER hook on
its `__init__` runs it. Prints one JSON line: the kernels warm-up compiled,
the gathers and scatters the sends launched, and what they compiled.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent), str(TESTS), str(TESTS / "integration" / "sglang")]

from aot_compile import Sm90Driver, compiled, counting_compile  # noqa: E402

# (item lengths, HiSparse device-backed buffers, sends of the request), as the interpreted test.
SCENARIOS = (([256] * 16, 0, 1), ([256] * 16, 0, 3), ([192] * 6 + [64] * 2, 2, 2))


def main() -> int:
    import numpy as np
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(Sm90Driver())
    JITFunction._do_compile = counting_compile(JITFunction._do_compile)
    os.environ.update(MOONCAKE_PROTOCOL="tcp", MC_FORCE_TCP="1")
    os.environ.update(
        GPU_PLANNER_STAGING_MIN_DESCRIPTORS="8",
        GPU_PLANNER_RECEIVE_STAGING_BYTES=str(4 << 20),
        GPU_PLANNER_GATHER_STAGING_BYTES=str(64 << 10),
    )
    import test_receive_staging_mooncake as staging
    from cuda_standin import HostCudaRuntime
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        MooncakeTransferEngine,
    )

    import gpu_planner.kernels
    from gpu_planner import settings
    from gpu_planner.cuda_runtime import use_cuda_runtime
    from gpu_planner.integration.sglang import prefill_routes
    from gpu_planner.integration.sglang.plugin import warm_up_gpu
    from gpu_planner.kernels import head_gather, head_scatter

    # The stand-in's device memory is host memory: let backend="triton" take CPU tensors.
    gpu_planner.kernels.interpreter_enabled = lambda: True
    settings.load()
    engines = MooncakeTransferEngine("127.0.0.1"), MooncakeTransferEngine("127.0.0.1")
    launches = {"gather": 0, "scatter": 0}  # every launch
    sent = {"gather": 0, "scatter": 0}  # the sends' launches
    warmed: set[str] = set()
    new_after_warmup: list[str] = []
    statuses = []
    for name, module, launcher in (
        ("gather", head_gather, "launch_gather_head_slices"),
        ("scatter", head_scatter, "launch_scatter_head_slices"),
    ):
        setattr(module, launcher, counted(launches, name, getattr(module, launcher)))
    with use_cuda_runtime(HostCudaRuntime()) as runtime:
        for item_lens, device_buffers, chunks in SCENARIOS:
            deployment = staging.Deployment(
                engines, item_lens, device_buffers, seed=chunks,
                place=lambda pool: runtime.place(pool.tensor, 0),
            )  # fmt: skip
            # What sglang's KVArgs hold on a prefill (the bench manager keeps what sends read).
            prefill = deployment.prefill
            prefill.kv_args.kv_item_lens = list(deployment.source.item_lens)
            prefill.kv_args.page_size = staging.PAGE_SIZE
            prefill.disaggregation_mode = DisaggregationMode.PREFILL
            before_warmup = len(compiled)
            for manager in (prefill, deployment.decode):
                warm_up_gpu(None, manager)
            warmed.update(name for name, _ in compiled[before_warmup:])
            after_warmup, warmup_launches = len(compiled), dict(launches)
            rng = np.random.default_rng(chunks)
            num_pages = 48
            src_pages = staging.fragmented(rng, num_pages, np.int64)
            host_pages = staging.fragmented(rng, num_pages)
            device_pages = staging.fragmented(rng, num_pages) if device_buffers else None
            info = deployment.request(7, host_pages, device_pages)
            cuts = np.linspace(0, num_pages, chunks + 1).astype(int)
            for first, end in zip(cuts[:-1], cuts[1:], strict=True):
                statuses.append(deployment.send(info, src_pages, slice(first, end)))
            deployment.deliver(7)
            statuses.append(deployment.decode.request_status[7])
            new_after_warmup += [name for name, _ in compiled[after_warmup:]]
            for name, count in warmup_launches.items():
                sent[name] += launches[name] - count
            deployment.close()
            prefill_routes.ROUTES.forget()
    print(
        json.dumps(
            {
                "warmed": sorted(warmed),
                "launches": sent,
                "new_after_warmup": new_after_warmup,
                "statuses": statuses,
            }
        )
    )
    return 0


def counted(launches: dict[str, int], name: str, launch):
    """`launch`, counting its calls under `name`."""

    def counting(*args, **kwargs):
        launches[name] += 1
        return launch(*args, **kwargs)

    return counting


if __name__ == "__main__":
    sys.exit(main())

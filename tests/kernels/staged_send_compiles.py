"""Staged and gathered sends after the plugin's warm-up, with every Triton compile counted
(sm_90 stand-in).

`staged` (the default): the staged sends of `test_receive_staging_mooncake`
(two real Mooncake engines over TCP, real managers, the plugin's hooks), with
both sides' KV standing for a GPU's through the CUDA stand-in
(tests/cuda_standin.py): the prefill gathers into device slots, the decode
scatters from a device region. `repaged`: the TP-up head-sliced sends of
`test_page_sizes_mooncake` (prefill TP 1 -> decode TP 2, rank 1) toward a
decode of another page size, gathered into device slots at pages of
gcd(page sizes) tokens; the decode registers after the prefill's manager is
built, as it does with sglang. `staged-repaged`: generic sends of
`test_page_sizes_mooncake` toward a decode of another page size that lends
receive staging in pages of gcd(page sizes) tokens (the CUDA stand-in on both
sides): a first request, then a second once the decode's scatter of those
pages compiled on its own thread; each compile is recorded with its thread.
The interpreter is off: Triton's JIT compiles each gather and scatter for the
sm_90 of `aot_compile` (which loads and launches nothing) and each compile is
counted; each launch's copy is then made by the CPU loops (`host_copy`), the
stand-in's device memory being host memory, so the bytes land.
`plugin.warm_up_gpu` runs for each manager first, as sglang's AFTER hook on
its `__init__` runs it. Prints one JSON line: the kernels warm-up (and the
decode's registration) compiled, the gathers and scatters the sends launched
(and their page sizes), and what they compiled.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent), str(TESTS), str(TESTS / "integration" / "sglang")]

from aot_compile import Sm90Driver, compiled, counting_compile  # noqa: E402

# (item lengths, HiSparse device-backed buffers, sends of the request), as the interpreted test.
SCENARIOS = (([256] * 16, 0, 1), ([256] * 16, 0, 3), ([192] * 6 + [64] * 2, 2, 2))
# (prefill page size, decode page size) of the repaged sends: units of 16 and 1 tokens.
REPAGED_PAIRS = ((64, 16), (16, 1))
KV_HEADS, HEAD_BYTES, LAYERS = 2, 8, 2  # the prefill's; each decode rank holds one head
ROOM, TOKENS = 19, 300
# (prefill page size, decode page size) of the staged repaged sends: units of 16 tokens, the
# decode's scatter of them compiled on its thread (16 -> 64) or the prefill's gather of them at
# the decode's registration (64 -> 16).
STAGED_REPAGED_PAIRS = ((16, 64), (64, 16))
FIRST_ROOM, SECOND_ROOM = 31, 32
SCATTER_COMPILE_TIMEOUT_S = 300  # a compile shares the cores with whatever else runs
compiled_on: list[tuple[str, str]] = []  # each compile's kernel and the thread that made it


def main(mode: str = "staged") -> int:
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(Sm90Driver())
    JITFunction._do_compile = thread_recorded(counting_compile(JITFunction._do_compile))
    os.environ.update(MOONCAKE_PROTOCOL="tcp", MC_FORCE_TCP="1")
    os.environ.update(
        GPU_PLANNER_STAGING_MIN_DESCRIPTORS="8",
        GPU_PLANNER_RECEIVE_STAGING_BYTES=str(4 << 20),
        GPU_PLANNER_GATHER_STAGING_BYTES=str(64 << 10),
    )
    import test_receive_staging_mooncake  # noqa: F401  (sglang, with the plugin loaded)
    from cuda_standin import HostCudaRuntime
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        MooncakeTransferEngine,
    )

    import gpu_planner.kernels
    from gpu_planner import settings
    from gpu_planner.cuda_runtime import use_cuda_runtime
    from gpu_planner.kernels import head_gather, head_scatter

    # The stand-in's device memory is host memory: let backend="triton" take CPU tensors.
    gpu_planner.kernels.interpreter_enabled = lambda: True
    settings.load()
    engines = MooncakeTransferEngine("127.0.0.1"), MooncakeTransferEngine("127.0.0.1")
    launched: dict[str, list[int]] = {"gather": [], "scatter": []}  # each launch's page size
    for name, module, launcher, host_copy in (
        ("gather", head_gather, "launch_gather_head_slices", gather_on_host),
        ("scatter", head_scatter, "launch_scatter_head_slices", scatter_on_host),
    ):
        launch = getattr(module, launcher)
        setattr(module, launcher, recorded(launched[name], launch, host_copy))
    sends = {
        "staged": staged_sends,
        "repaged": repaged_sends,
        "staged-repaged": staged_repaged_sends,
    }
    with use_cuda_runtime(HostCudaRuntime()) as runtime:
        print(json.dumps(sends[mode](engines, runtime, launched)))
    return 0


def staged_sends(engines, runtime, launched: dict[str, list[int]]) -> dict:
    """`SCENARIOS`' staged sends, each deployment's managers warmed up first."""
    import test_receive_staging_mooncake as staging
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from gpu_planner.integration.sglang import prefill_routes
    from gpu_planner.integration.sglang.plugin import warm_up_gpu

    sent = {"gather": 0, "scatter": 0}  # the sends' launches
    warmed: set[str] = set()
    new_after_warmup: list[str] = []
    statuses = []
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
        after_warmup = len(compiled)
        warmup_launches = {name: len(pages) for name, pages in launched.items()}
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
            sent[name] += len(launched[name]) - count
        deployment.close()
        prefill_routes.ROUTES.forget()
    return {
        "warmed": sorted(warmed),
        "launches": sent,
        "new_after_warmup": new_after_warmup,
        "statuses": statuses,
    }


def repaged_sends(engines, runtime, launched: dict[str, list[int]]) -> dict:
    """`REPAGED_PAIRS`' sends, each pair's managers ended before the next pair's are built."""
    import gc

    report: dict[str, list] = {}
    for pair in REPAGED_PAIRS:
        for key, value in repaged_send(engines, runtime, launched, *pair).items():
            report.setdefault(key, []).append(value)
        gc.collect()  # the pair's managers end: the next decode's registration skips them
    return report


def repaged_send(
    engines, runtime, launched: dict[str, list[int]], prefill_page_size: int, decode_page_size: int
) -> dict:
    """A TP-up send in two chunks from a prefill manager warmed up when built, after the
    decode's registration: the compiles of each step, the gathers' page sizes, the statuses."""
    import pytest
    import test_page_sizes_mooncake as page_size_tests
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang_plugin_support import conn, deliver_status, make_manager

    from gpu_planner.integration.sglang import page_sizes, send_slots
    from gpu_planner.integration.sglang.plugin import warm_up_gpu

    monkeypatch = pytest.MonkeyPatch()
    widths = ([KV_HEADS * HEAD_BYTES] * 2 * LAYERS, [HEAD_BYTES] * 2 * LAYERS)
    pair = page_size_tests.Pair(
        engines, monkeypatch, prefill_page_size, decode_page_size, token_bytes=widths
    )
    for pool in (pair.source, pair.destination):
        runtime.place(pool.tensor, 0)
    # The sending rank's manager, built (and warmed up) as sglang builds it.
    prefill = make_manager(
        pair.prefill.engine, kv_data_ptrs=pair.source.ptrs, kv_data_lens=pair.source.lens
    )
    prefill.disaggregation_mode, prefill.attn_tp_size = DisaggregationMode.PREFILL, 1
    kv_args = prefill.kv_args
    kv_args.page_size, kv_args.kv_item_lens = prefill_page_size, pair.source.item_lens
    kv_args.kv_layer_ids, kv_args.engine_rank = [], 0
    kv_args.kv_head_num = kv_args.total_kv_head_num = KV_HEADS
    prefill.decode_kv_args_table = pair.prefill.decode_kv_args_table
    before = len(compiled)
    warm_up_gpu(None, prefill)
    page_sizes.manager_built_hook(None, prefill)
    after_warmup = len(compiled)
    pair.register()  # the decode's registration, parsed by this prefill process
    after_registration = len(compiled)
    src_pages, dst_pages = request_pages(prefill_page_size, decode_page_size)
    info = conn.TransferInfo.from_zmq(pair.metadata(ROOM, dst_pages))
    prefill.transfer_infos[ROOM] = {pair.session: info}
    gathers = len(launched["gather"])
    cuts = [0, len(src_pages) // 2, len(src_pages)]
    statuses = [
        conn.MooncakeKVManager.send_kvcache_slice(
            prefill,
            pair.session,
            src_pages[first:end],
            pair.destination.ptrs,
            info.dst_kv_indices[first:end],
            1,
            2,
            pair.destination.item_lens[0],
            page_size_tests.SLICE_EXECUTOR,
        )  # fmt: skip
        for first, end in zip(cuts[:-1], cuts[1:], strict=True)
    ]
    send_slots.SEND_SLOTS.release(prefill)
    deliver_status(prefill, pair.decode, ROOM, page_size_tests.KV_POLL_SUCCESS)
    statuses.append(pair.decode.request_status[ROOM])
    pair.close()
    page_sizes.PREFILL.forget()
    monkeypatch.undo()
    return {
        "warmup": after_warmup - before,
        "registration": after_registration - after_warmup,
        "gather_page_sizes": sorted(set(launched["gather"][gathers:])),
        "statuses": statuses,
        "new_after_registration": [name for name, _ in compiled[after_registration:]],
    }


def staged_repaged_sends(engines, runtime, launched: dict[str, list[int]]) -> dict:
    """`STAGED_REPAGED_PAIRS`' requests, each pair's managers ended and Triton's kernels
    dropped before the next pair's are built: as in a process of its own, a variant one pair
    compiled hides none that the next pair's warm-up misses."""
    import gc

    from gpu_planner.kernels import head_gather, head_scatter

    report: dict[str, list] = {}
    for pair in STAGED_REPAGED_PAIRS:
        for key, value in staged_repaged_send(engines, runtime, launched, *pair).items():
            report.setdefault(key, []).append(value)
        gc.collect()  # the pair's managers end: the next decode's registration skips them
        for kernel in (
            head_gather._gather_head_slices_kernel,
            head_scatter._scatter_head_slices_kernel,
        ):
            kernel.device_caches.clear()
    return report


def staged_repaged_send(
    engines, runtime, launched: dict[str, list[int]], prefill_page_size: int, decode_page_size: int
) -> dict:
    """Both managers warmed up as sglang builds them, then the decode's registration; a first
    request (direct while the decode's unit scatter compiles on its thread), then a second once
    that compile is done (lent, staged, scattered). The compiles of each step with their
    threads, the second's launches' page sizes, and each request's lending, notes, statuses and
    whether the decode's pool then holds its sent bytes."""
    import pytest
    import test_page_sizes_mooncake as page_size_tests
    from sglang_plugin_support import deliver_status

    from gpu_planner.integration.sglang import page_sizes, prefill_routes, receive_staging
    from gpu_planner.integration.sglang.plugin import warm_up_gpu

    monkeypatch = pytest.MonkeyPatch()
    before = len(compiled_on)
    after_warmup = []

    def warmed_up(manager) -> None:
        warm_up_gpu(None, manager)
        after_warmup.append(len(compiled_on))

    pair = page_size_tests.Pair(
        engines, monkeypatch, prefill_page_size, decode_page_size, place=runtime.place,
        built=warmed_up,
    )  # fmt: skip
    after_registration = len(compiled_on)
    pair.keep_notes(pair.prefill)
    region = receive_staging.REGIONS.existing(pair.decode)
    src_pages, dst_pages = request_pages(prefill_page_size, decode_page_size)
    expected = pair.expected_pool(src_pages, dst_pages)

    def request(room: int) -> dict:
        pair.destination.tensor.zero_()
        info = pair.parse(room, pair.metadata(room, dst_pages))
        lent = region.lent_rooms
        cuts = [0, len(src_pages) // 2, len(src_pages)]
        statuses = pair.send_chunks(info, src_pages, cuts, page_size_tests.STAGING_EXECUTOR)
        notes = pair.deliver_notes()
        deliver_status(pair.prefill, pair.decode, room, page_size_tests.KV_POLL_SUCCESS)
        statuses.append(pair.decode.request_status[room])
        landed = bool(np.array_equal(pair.destination.tensor.numpy(), expected))
        return {"lent": lent, "staged_notes": notes, "statuses": statuses, "landed": landed}

    first = request(FIRST_ROOM)
    deadline = time.monotonic() + SCATTER_COMPILE_TIMEOUT_S
    while region.scatter_unready(math.gcd(prefill_page_size, decode_page_size)):
        assert time.monotonic() < deadline, "the decode's scatter compile did not end"
        time.sleep(0.05)
    scatter_compiled = len(compiled_on)
    launches = {name: len(pages) for name, pages in launched.items()}
    second = request(SECOND_ROOM)
    pair.close()
    page_sizes.PREFILL.forget()
    prefill_routes.ROUTES.forget()
    monkeypatch.undo()
    return {
        "warmup": after_warmup[-1] - before,
        "registration": after_registration - after_warmup[-1],
        "until_scatter_compiled": compiled_on[after_registration:scatter_compiled],
        "first": first,
        "second": second,
        "second_page_sizes": {
            name: sorted(set(pages[launches[name] :])) for name, pages in launched.items()
        },
        "new_in_second": compiled_on[scatter_compiled:],
    }


def request_pages(prefill_page_size: int, decode_page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A request of TOKENS tokens: its fragmented prefill pages (int64) and decode pages."""
    import test_page_sizes_mooncake as page_size_tests

    rng = np.random.default_rng(prefill_page_size + decode_page_size)
    src_pages = page_size_tests.shuffled_pages(
        rng, -(-TOKENS // prefill_page_size), prefill_page_size
    ).astype(np.int64)
    dst_pages = page_size_tests.shuffled_pages(
        rng, -(-TOKENS // decode_page_size), decode_page_size
    )
    return src_pages, dst_pages


def thread_recorded(do_compile):
    """`do_compile`, appending each compile's kernel and thread to `compiled_on`."""

    def compile_recorded(self, *args, **kwargs):
        kernel = do_compile(self, *args, **kwargs)
        compiled_on.append((self._fn_name, threading.current_thread().name))
        return kernel

    return compile_recorded


def recorded(page_sizes: list[int], launch, host_copy):
    """`launch`, appending each call's page size (its last argument) to `page_sizes`, then
    making its copy with `host_copy` (the stand-in's device memory is host memory)."""

    def recording(*args):
        page_sizes.append(args[-1])
        launch(*args)
        host_copy(*args)

    return recording


def gather_on_host(staging, src_pages, entries, page_size: int) -> None:
    """`launch_gather_head_slices`' copy, by the CPU loop."""
    from gpu_planner.host_copy import gather_loop

    absolute = entries.copy()
    absolute[:, 3] += staging.data_ptr()
    gather_loop(absolute, src_pages.numpy().astype(np.int64), page_size)


def scatter_on_host(staging, dst_pages, dst_device_pages, entries, page_size: int) -> None:
    """`launch_scatter_head_slices`' copy, by the CPU loop."""
    from gpu_planner.host_copy import scatter_loop

    absolute = entries.copy()
    absolute[:, 0] += staging.data_ptr()
    device_pages = dst_pages if dst_device_pages is None else dst_device_pages
    page_rows = np.stack([dst_pages.numpy(), device_pages.numpy()]).astype(np.int64)
    scatter_loop(absolute, page_rows, page_size)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

"""TEST SCAFFOLDING, not product code: a test-only sglang plugin for the e2e servers.

Found by sglang's `load_plugins()` through the entry point in the
`e2e_sglang_scaffolding-0.dist-info` folder next to it (`tests/e2e/conftest.py`
puts this folder on the PYTHONPATH of every server the suite starts; nothing is
installed). What sglang's CPU path needs is not here but in the launcher's CPU
scaffolding (`bench/servers/cpu_scaffolding/`), which the benchmarks use too.
Each control below is armed per server by its environment variable, and does
nothing without it:

- The corruption control: when `E2E_CORRUPT_FLAG` names a file, an AROUND hook
  on `MooncakeKVManager.send_kvcache` (upstream of every planner) leaves the
  last page out of the next send with two or more pages after that file
  appears, and deletes the file: exactly one transfer skips one page's KV and
  reports success, and decode attends to whatever that page held. The e2e
  suite asserts that this changes the tokens. (Moving pages instead, such as
  reversing the decode page list, would not: attention over a request's KV is
  the same in any slot order, since keys carry their positions from RoPE.)
- The receive-staging control: when `E2E_CORRUPT_SCATTER_FLAG` names a file, the
  decode's next scatter of a staged chunk of two or more pages after that file
  appears leaves its last page out (gpu_planner's `receive_staging` module is
  patched), and the file is deleted: the staged bytes arrived, one page of them
  never reaches the KV pool.
- The killed-decode check: when `E2E_STALL_STAGED_FLAG` names a file, the
  prefill's next staged send after that file appears writes its chunk and
  sends its note, then creates `<flag>.written` and holds its transfer
  thread until `<flag>.go` exists (at most `STALL_LIMIT_S`; it deletes
  `<flag>.go` when it goes on): the test kills
  the decode in between, so the request's next chunk meets a dead peer.
- The retried-room check: when `E2E_HOLD_NOTE_FLAG` names a file, the
  prefill's next staged send after that file appears writes its chunk, creates
  `<flag>.written` and holds its note (and its transfer thread) until
  `<flag>.go` exists (deleting it, as above), then sends the note: the test
  aborts the request on the decode in between, so the note arrives for a
  lending that has ended.
- The cost-model window: when `E2E_COST_MODEL_FLAG` names a file, the prefill's
  sends are decided, while that file exists, by the send-path cost model as a
  prefill without `GPU_PLANNER_STAGING_*` builds it (`PathCosts.from_settings()`,
  its seeds and probe interval from the settings, without the override gate
  those knobs set): a fresh instance for each file created (each window
  starts from the seeds), built at its first send. Each of its choices and
  observations is logged (the log says why a path won). Outside a window the
  process's own instance (the gate) decides. The test removes the file only
  once its requests have answered, so every send chosen in the window was
  observed in it too (a send's time is learned before its request completes).
- The page-size mapping control: when `E2E_MISMAP_PAGES_FLAG` names a file, the
  prefill's next chunk toward a decode of another page size after that file
  appears (a chunk after the request's first: the first one maps the same
  either way) is planned as sglang's own chunking would address it: the
  decode's page list cut at the chunk's prefill page position, as if the
  decode's pages were the prefill's size (gpu_planner's `send` module is
  patched around `page_sizes.unit_send`), and the file is deleted. The chunk
  lands in the decode pages of earlier tokens (overwriting their KV) and its
  own decode pages keep whatever they held; the chunk still declares the
  tokens it covered, so the decode admits the request and the tokens tell.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path

CORRUPT_FLAG_ENV = "E2E_CORRUPT_FLAG"
CORRUPT_SCATTER_FLAG_ENV = "E2E_CORRUPT_SCATTER_FLAG"
STALL_STAGED_FLAG_ENV = "E2E_STALL_STAGED_FLAG"
HOLD_NOTE_FLAG_ENV = "E2E_HOLD_NOTE_FLAG"
COST_MODEL_FLAG_ENV = "E2E_COST_MODEL_FLAG"
MISMAP_PAGES_FLAG_ENV = "E2E_MISMAP_PAGES_FLAG"
STALL_LIMIT_S = 120.0
SEND_KVCACHE = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache"

logger = logging.getLogger(__name__)


def register() -> None:
    """The `sglang.srt.plugins` entry point: arm the controls whose variables are set."""
    if os.environ.get(CORRUPT_FLAG_ENV):
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(SEND_KVCACHE, corrupt_one_send, HookType.AROUND)
    if os.environ.get(CORRUPT_SCATTER_FLAG_ENV):
        from gpu_planner.integration.sglang import receive_staging

        receive_staging.scatter_head_slices = _corrupting_scatter(
            receive_staging.scatter_head_slices
        )
    if os.environ.get(STALL_STAGED_FLAG_ENV):
        from gpu_planner.integration.sglang import staged_send

        staged_send._notify = _stalling_notify(staged_send._notify)
    if os.environ.get(HOLD_NOTE_FLAG_ENV):
        from gpu_planner.integration.sglang import staged_send

        staged_send._notify = _holding_notify(staged_send._notify)
    if os.environ.get(COST_MODEL_FLAG_ENV):
        from gpu_planner.integration.sglang import send_path

        send_path.path_costs = _model_while_flagged(send_path.path_costs)
    if os.environ.get(MISMAP_PAGES_FLAG_ENV):
        from gpu_planner.integration.sglang import send

        send.unit_send = _mismapping_unit_send(send.unit_send)


def corrupt_one_send(original, manager, session, src_pages, dst_ptrs, dst_pages, *args, **kwargs):
    """Leave out the last page of one send with two or more pages once the flag file exists."""
    if len(dst_pages) >= 2 and _claim_flag(os.environ[CORRUPT_FLAG_ENV]):
        logger.warning(
            "e2e scaffolding: corrupting one send (last of %d pages left out)", len(dst_pages)
        )
        src_pages, dst_pages = src_pages[:-1], dst_pages[:-1]
    return original(manager, session, src_pages, dst_ptrs, dst_pages, *args, **kwargs)


def _corrupting_scatter(scatter):
    """`scatter` leaving out the last page of one chunk once the flag file exists."""

    def scatter_head_slices(layout, dst_pages, *args, dst_device_pages=None, **kwargs):
        if len(dst_pages) >= 2 and _claim_flag(os.environ[CORRUPT_SCATTER_FLAG_ENV]):
            logger.warning("e2e scaffolding: one staged page not scattered")
            dst_pages = dst_pages[:-1]
            dst_device_pages = None if dst_device_pages is None else dst_device_pages[:-1]
        return scatter(layout, dst_pages, *args, dst_device_pages=dst_device_pages, **kwargs)

    return scatter_head_slices


def _mismapping_unit_send(unit_send):
    """`unit_send`, but once the flag file exists, one later chunk's decode pages are those at
    its prefill page position in the decode's page list (the decode's pages taken for pages of
    the prefill's size): what sglang's own chunking would address."""

    def mismapped_unit_send(route, position, src_pages, page_size):
        chunk = unit_send(route, position, src_pages, page_size)
        if position == 0 or not _claim_flag(os.environ[MISMAP_PAGES_FLAG_ENV]):
            return chunk
        from gpu_planner.page_geometry import PageGeometry, unit_pages

        geometry = PageGeometry(route.decode_page_size, chunk.first % route.decode_page_size)
        tokens = chunk.end - chunk.first
        wrong = unit_pages(route.decode_pages[position:], geometry, chunk.unit, tokens, "mismap")
        logger.warning(
            "e2e scaffolding: tokens %d-%d (prefill page size %d, position %d) mapped to the "
            "decode's pages from %d, not %d (page size %d)", chunk.first, chunk.end, page_size,
            position, position, chunk.first // route.decode_page_size, route.decode_page_size,
        )  # fmt: skip
        return dataclasses.replace(chunk, dst_pages=wrong)

    return mismapped_unit_send


def _stalling_notify(notify):
    """`notify`, then once the flag file exists: say so, and hold until told to go."""

    def stalling_notify(*args, **kwargs):
        notify(*args, **kwargs)
        flag = os.environ[STALL_STAGED_FLAG_ENV]
        if _claim_flag(flag):
            logger.warning("e2e scaffolding: a staged send written; holding its thread")
            _hold(flag)

    return stalling_notify


def _holding_notify(notify):
    """`notify`, held until told to go once the flag file exists (the chunk is written)."""

    def holding_notify(*args, **kwargs):
        flag = os.environ[HOLD_NOTE_FLAG_ENV]
        if _claim_flag(flag):
            logger.warning("e2e scaffolding: a staged chunk written; holding its note")
            _hold(flag)
            logger.warning("e2e scaffolding: the held note goes")
        notify(*args, **kwargs)

    return holding_notify


def _model_while_flagged(path_costs):
    """`path_costs`, but while the flag file exists the cost model without the override gate:
    a fresh one for each file created (a window), kept while that file exists."""
    window = {}  # the flag file's identity -> its PathCosts
    lock = threading.Lock()

    def costs():
        try:
            flag = os.stat(os.environ[COST_MODEL_FLAG_ENV])
        except FileNotFoundError:
            return path_costs()
        key = (flag.st_ino, flag.st_mtime_ns)
        with lock:
            if key not in window:
                from gpu_planner.integration.sglang.path_cost import PathCosts

                built = PathCosts.from_settings()
                built.gate = None  # what a prefill without GPU_PLANNER_STAGING_* decides by
                logger.warning("e2e scaffolding: the cost model decides while the flag exists")
                window.clear()
                window[key] = _logged(built)
            return window[key]

    return costs


def _logged(costs):
    """`costs`, each choice and observation logged (the server's log tells why a path won)."""
    choose, observe = costs.choose, costs.observe

    def logged_choose(peer, descriptors, nbytes, staged_pieces):
        choice = choose(peer, descriptors, nbytes, staged_pieces)
        logger.warning(
            "e2e scaffolding: cost model: %d descriptors, %d bytes, %d pieces -> %s "
            "(direct %.2f ms, staged %.2f ms)", descriptors, nbytes, staged_pieces, choice.path,
            choice.direct_s * 1e3, choice.staged_s * 1e3,
        )  # fmt: skip
        return choice

    def logged_observe(peer, path, requests, nbytes, seconds, ok=True):
        learned = observe(peer, path, requests, nbytes, seconds, ok)
        logger.warning(
            "e2e scaffolding: cost model: %s send of %d requests, %d bytes took %.2f ms%s",
            path, requests, nbytes, seconds * 1e3, "" if learned else " (not learned from)",
        )  # fmt: skip
        return learned

    costs.choose, costs.observe = logged_choose, logged_observe
    return costs


def _hold(flag: str) -> None:
    """Create `<flag>.written`, then wait until `<flag>.go` exists (at most STALL_LIMIT_S) and
    delete it: a test that sees it gone knows the thread goes on."""
    Path(f"{flag}.written").touch()
    go = f"{flag}.go"
    deadline = time.monotonic() + STALL_LIMIT_S
    while not _claim_flag(go) and time.monotonic() < deadline:
        time.sleep(0.05)


def _claim_flag(path: str) -> bool:
    """Delete the flag file; True for the one caller that deleted it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
        return True
    return False

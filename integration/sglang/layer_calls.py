"""Per-layer engine calls from sglang's executor, made the way sglang awaits them.

Where sglang makes one engine call per layer (head-sliced sends, and the
generic send with a custom memory pool), it submits one executor task per
layer and awaits their futures with `_await_transfer_futures`. For an
80-layer model that is 160 submits and their callbacks with the GIL held in
the sending thread (docs/sglang.md). `submit_in_order` submits one task per
executor thread instead; each makes the next unmade call until none is left or
one has failed, so the calls start in sglang's order, one per layer, from the
executor's threads, and a failure stops the others from taking more (as
sglang cancels its queued layers). `_await_transfer_futures` turns the tasks'
results into sglang's status and drains the running ones where sglang does.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from collections.abc import Callable


def submit_in_order(
    executor: concurrent.futures.Executor,
    num_calls: int,
    make_call: Callable[[int], int],
    futures: list[concurrent.futures.Future],
    max_tasks: int | None = None,
) -> None:
    """Make `make_call(0)` .. `make_call(num_calls - 1)` from `executor`'s threads, in order.

    Appends one future per task to `futures` as it submits (so that a caller
    whose submit raises still holds the tasks already running). A task returns
    0, or the first non-zero status it got, or raises what its call raised;
    after either, no task starts another call. A ThreadPoolExecutor gets one
    task per worker thread (at most `num_calls`); an executor that does not
    say how many threads it has gets one task per call; `max_tasks` caps the
    tasks (1: the calls one after another, from one executor thread).
    """
    next_call = itertools.count()  # next() is atomic: each call is made once
    failed = threading.Event()

    def make_next_calls() -> int:
        while not failed.is_set():
            index = next(next_call)
            if index >= num_calls:
                return 0
            try:
                status = make_call(index)
            except BaseException:
                failed.set()
                raise
            if status != 0:
                failed.set()
                return status
        return 0

    tasks = min(num_calls, getattr(executor, "_max_workers", num_calls), max_tasks or num_calls)
    for _ in range(tasks):
        futures.append(executor.submit(make_next_calls))

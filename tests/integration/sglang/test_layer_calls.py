"""submit_in_order: every call once, in order, from the executor's threads; a failure stops them."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from gpu_planner.integration.sglang.layer_calls import submit_in_order


class CountingPool(concurrent.futures.ThreadPoolExecutor):
    def __init__(self, max_workers: int) -> None:
        super().__init__(max_workers=max_workers)
        self.submitted = 0

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def run_calls(executor, num_calls: int, status_of=lambda index: 0) -> tuple[list, list[int]]:
    """(futures' results or exceptions, the calls made in start order)."""
    made: list[int] = []
    lock = threading.Lock()

    def make_call(index: int) -> int:
        with lock:
            made.append(index)
        return status_of(index)

    futures: list[concurrent.futures.Future] = []
    submit_in_order(executor, num_calls, make_call, futures)
    outcomes = [future.exception() or future.result() for future in futures]
    return outcomes, made


@pytest.mark.parametrize(("num_calls", "workers"), [(160, 3), (5, 1), (2, 8), (0, 4)])
def test_every_call_once_in_order_from_one_task_per_thread(num_calls: int, workers: int):
    with CountingPool(workers) as pool:
        outcomes, made = run_calls(pool, num_calls)
    assert pool.submitted == min(num_calls, workers)
    assert outcomes == [0] * pool.submitted
    assert sorted(made) == list(range(num_calls))
    if workers == 1:
        assert made == list(range(num_calls))


def test_a_failing_status_stops_every_task():
    with CountingPool(1) as pool:
        outcomes, made = run_calls(pool, 10, status_of=lambda index: 7 if index == 3 else 0)
    assert outcomes == [7]
    assert made == [0, 1, 2, 3]


def test_a_raising_call_stops_every_task_and_surfaces():
    def status_of(index: int) -> int:
        if index == 2:
            raise RuntimeError("engine exploded")
        return 0

    with CountingPool(1) as pool:
        outcomes, made = run_calls(pool, 10, status_of)
    assert isinstance(outcomes[0], RuntimeError) and made == [0, 1, 2]


def test_an_executor_without_a_worker_count_gets_one_task_per_call():
    class Plain(concurrent.futures.Executor):
        def __init__(self) -> None:
            self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
            self.submitted = 0

        def submit(self, fn, /, *args, **kwargs):
            self.submitted += 1
            return self.pool.submit(fn, *args, **kwargs)

    executor = Plain()
    outcomes, made = run_calls(executor, 6)
    executor.pool.shutdown()
    assert executor.submitted == 6 and sorted(made) == list(range(6))


def test_one_task_makes_the_calls_one_after_another_on_a_larger_pool():
    made: list[int] = []
    futures: list[concurrent.futures.Future] = []
    with CountingPool(4) as pool:
        submit_in_order(pool, 9, lambda index: made.append(index) or 0, futures, max_tasks=1)
        assert [future.result() for future in futures] == [0]
    assert pool.submitted == 1 and made == list(range(9))

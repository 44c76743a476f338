"""The GIL monitor sees a hold where the GIL is held, none where it is free, and the waits.

Each case holds or frees the GIL for tens of milliseconds, against the
monitor's 0.1 ms sampling. No check compares with a share of wall time, which a
busy machine stretches by preempting the holder or the monitor: holds are
compared with the holder's own CPU time (`time.thread_time`, which preemption
does not grow) within the sample gaps the monitor reports, and upper bounds
with the wall time of the whole call, which nothing seen inside it can exceed.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from bench.gil import (
    _NO_CLOCK,
    GilMonitor,
    _holder_cpu_clock,
    _native_id_offset,
    _read_iovecs,
    _this_thread_state,
)

HOLD_CPU_S = 0.05  # each hold's CPU time, far above the sampling
CLOCK_SLACK_S = 1e-3  # the Python around a hold, and clock reads


def counts_for(seconds: float) -> int:
    """How many counts `hold_the_gil` needs to run about `seconds` of this thread's CPU time."""
    count = 1_000_000
    start = time.thread_time()
    sum(range(count))
    return int(seconds * count / max(time.thread_time() - start, 1e-9))


def hold_the_gil(count: int) -> float:
    """Keep the GIL in one C call (no bytecode runs to give it up); its CPU seconds."""
    start = time.thread_time()
    sum(range(count))
    return time.thread_time() - start


@pytest.fixture(scope="module")
def monitor():
    with GilMonitor() as running:
        yield running


def seen_whole(window, ran: float) -> bool:
    """The longest hold's running time is all of `ran` but what its end gaps can miss."""
    missed = 2 * window.sample_gap + CLOCK_SLACK_S
    return ran - missed <= window.running <= ran + CLOCK_SLACK_S


def test_a_hold_in_c_code_is_seen_whole(monitor):
    count = counts_for(HOLD_CPU_S)
    ran = []
    window = monitor.window(lambda: ran.append(hold_the_gil(count)))
    assert ran[0] > HOLD_CPU_S / 2
    assert window.holder == threading.current_thread().name
    assert seen_whole(window, ran[0]), (window, ran[0])
    assert window.running <= window.hold + 2 * window.sample_gap + CLOCK_SLACK_S


def test_sleeping_holds_nothing(monitor):
    """While the caller sleeps no thread computes with the GIL: every hold is short in CPU time."""
    before = time.perf_counter()
    window = monitor.window(lambda: time.sleep(0.05))
    call = time.perf_counter() - before
    assert window.elapsed >= 0.05
    assert window.running < CLOCK_SLACK_S
    assert window.hold <= call and window.wait <= call


def test_a_ready_thread_waits_while_another_holds(monitor):
    """The probe, ready to run, waits through most of another thread's hold.

    The probe wakes every 0.2 ms: the scheduler gives it a core long before
    the holder has run half of its hold's CPU time, however busy the machine.
    """
    count = counts_for(HOLD_CPU_S)
    held, done = threading.Event(), threading.Event()
    ran = []

    def hold_then_wait() -> None:
        ran.append(hold_the_gil(count))
        held.set()
        done.wait()  # alive until the window is read: its name can still be found

    holder = threading.Thread(target=hold_then_wait, name="holder")

    def other_thread_holds() -> None:
        holder.start()
        held.wait()

    window = monitor.window(other_thread_holds)
    done.set()
    holder.join()
    assert window.holder == "holder"
    assert seen_whole(window, ran[0]), (window, ran[0])
    assert window.wait >= 0.5 * window.running


def test_the_hold_counts_from_the_window_start(monitor):
    """A hold that began before the window (the caller's own code) is cut at its start."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # the caller keeps the GIL from its loop into the window
    try:
        stop = time.thread_time() + 0.03
        while time.thread_time() < stop:  # bytecode: holds the GIL, drops it only on request
            pass
        before = time.perf_counter()
        window = monitor.window(lambda: None)
        call = time.perf_counter() - before
    finally:
        sys.setswitchinterval(interval)
    assert window.hold <= call  # uncut, it would count the loop's 30 ms


def test_the_monitor_follows_the_switch_interval_it_found():
    """The GIL state it reads moves with sys.setswitchinterval: the right words were found."""
    interval = sys.getswitchinterval()
    with GilMonitor() as watching:
        gil = watching._gil
        sys.setswitchinterval(0.002)
        try:
            assert gil[0] == 2000  # microseconds
        finally:
            sys.setswitchinterval(interval)
        assert isinstance(watching.realtime, bool)


def test_a_holder_whose_state_is_gone_has_no_clock():
    """Reading a freed thread state fails cleanly (process_vm_readv), never crashes."""
    iovecs = _read_iovecs()
    assert _holder_cpu_clock(os.getpid(), 8, iovecs) == _NO_CLOCK  # unmapped page 0
    address = _this_thread_state() + _native_id_offset()
    clock = _holder_cpu_clock(os.getpid(), address, iovecs)
    assert iovecs[2, 0] == threading.get_native_id()
    assert time.clock_gettime(clock) > 0  # this thread's CPU time

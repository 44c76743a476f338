"""The GIL monitor sees a hold where the GIL is held, none where it is free, and the waits.

Each case holds or frees the GIL for tens of milliseconds, against the
monitor's 0.1 ms sampling: the checks leave a factor of two for a busy machine.
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


def hold_the_gil(seconds: float) -> None:
    """Keep the GIL for about `seconds` in one C call (no bytecode runs to give it up)."""
    count = 1_000_000
    start = time.perf_counter()
    sum(range(count))
    per_count = (time.perf_counter() - start) / count
    sum(range(int(seconds / per_count)))


@pytest.fixture(scope="module")
def monitor():
    with GilMonitor() as running:
        yield running


def test_a_hold_in_c_code_is_seen_whole(monitor):
    window = monitor.window(lambda: hold_the_gil(0.05))
    assert window.holder == threading.current_thread().name
    assert window.elapsed > 0.02
    assert window.hold >= 0.5 * window.elapsed
    assert window.running >= 0.5 * window.elapsed
    assert window.running <= window.hold + 2 * window.sample_gap + 1e-3


def test_sleeping_holds_nothing(monitor):
    window = monitor.window(lambda: time.sleep(0.05))
    assert window.elapsed >= 0.05
    assert window.hold < 0.1 * window.elapsed
    assert window.wait < 0.1 * window.elapsed


def test_a_ready_thread_waits_while_another_holds(monitor):
    held, done = threading.Event(), threading.Event()

    def hold_then_wait() -> None:
        hold_the_gil(0.05)
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
    assert window.wait >= 0.5 * window.elapsed
    assert window.hold >= 0.5 * window.elapsed


def test_the_hold_counts_from_the_window_start(monitor):
    """A hold that began before the window (the caller's own code) is cut at its start."""
    window = monitor.window(lambda: None)
    assert window.hold < 0.01


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

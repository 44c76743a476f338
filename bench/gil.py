"""How long a send keeps the GIL: each hold, read from CPython's own GIL state, and the waits.

`GilMonitor` runs two threads while a benchmark times its calls:

- a sampler without the GIL (a Numba `nogil` loop) that reads CPython's GIL
  state (`_PyRuntime.ceval.gil`: locked, the last holder, and a switch number
  that grows at every acquisition) every `SAMPLE_S`. Samples that see the GIL
  locked with the same switch number lie within one hold: the span from the
  first to the last of them is a lower bound on that hold, at most two sample
  gaps short of it (`sample_gap` reports the largest gap). For each hold it
  also reads the holder's own CPU clock: `running` is how long the holder
  actually ran during the hold. Where threads outnumber cores (a 2-core test
  machine), a holder can be preempted with the GIL held and the wall-clock
  hold grows by the time it waited for a core; `running` is the hold the code
  itself makes.
- a probe that wakes every `WAIT_PROBE_S`, stamps the time without the GIL and
  records how long it then waits for the GIL: what a thread that is ready to
  run (sglang's scheduler) feels, convoys of several holds included.

Both threads ask for real-time scheduling (SCHED_FIFO, the lowest priority)
so that the operating system runs them the moment they wake (on a 2-core
machine a busy thread could otherwise keep them off a core for milliseconds,
hiding holds from the sampler and adding to the waits); `realtime` says whether
it was granted (it needs CAP_SYS_NICE or root).

Linux and CPython 3.8-3.12 (where `struct _gil_runtime_state` starts with
interval, last holder, locked, switch number); elsewhere `GilMonitor` raises.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_CLOCK_MONOTONIC = 1  # time.perf_counter's clock on Linux (checked in GilMonitor)
_PR_SET_TIMERSLACK = 29
_clock_gettime = _LIBC.clock_gettime
_clock_gettime.argtypes = [ctypes.c_int, ctypes.c_void_p]
_clock_gettime.restype = ctypes.c_int
_nanosleep = _LIBC.nanosleep
_nanosleep.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_nanosleep.restype = ctypes.c_int
# Reads another thread's PyThreadState, which that thread may free at any time:
# process_vm_readv on this process fails (EFAULT) where memcpy would crash.
_process_vm_readv = _LIBC.process_vm_readv  # (pid, local iovec, 1, remote iovec, 1, 0)
_process_vm_readv.argtypes = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_process_vm_readv.restype = ctypes.c_ssize_t
_prctl = _LIBC.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int

# The first words of CPython's `struct _gil_runtime_state`, as uint64.
_INTERVAL, _LAST_HOLDER, _LOCKED, _SWITCH_NUMBER = range(4)
# The sampler's control words (int64, shared with Python).
_STOP, _WINDOW_START, _LONGEST_HOLD, _LONGEST_RUNNING, _LONGEST_GAP, _HOLDER = range(6)
_LAST_SAMPLE = 6  # the time of the latest sample whose hold and running time are written


@numba.njit(nogil=True)
def _clock_ns(clock: int, timespec: np.ndarray) -> int:
    """`clock`'s time in ns, or -1 where it cannot be read (a thread that has ended)."""
    if _clock_gettime(clock, timespec.ctypes.data) != 0:
        return -1
    return timespec[0] * 1_000_000_000 + timespec[1]


_NO_CLOCK = 0  # CLOCK_REALTIME: never a thread's CPU clock (those ids are negative)


@numba.njit(nogil=True)
def _read_iovecs() -> np.ndarray:
    """`_holder_cpu_clock`'s scratch, int64 [3, 2]: the read's local and remote `struct
    iovec`, then the word it lands in (the local iovec already points at it)."""
    iovecs = np.zeros((3, 2), dtype=np.int64)
    iovecs[0, 0], iovecs[0, 1], iovecs[1, 1] = iovecs[2].ctypes.data, 8, 8
    return iovecs


@numba.njit(nogil=True)
def _holder_cpu_clock(pid: int, native_id_address: int, iovecs: np.ndarray) -> int:
    """The CPU clock (a Linux clockid) of the thread whose native id is at `native_id_address`.

    `iovecs` comes from `_read_iovecs`; the native id is left in iovecs[2, 0].
    _NO_CLOCK where that thread state cannot be read (it was freed).
    """
    iovecs[1, 0] = native_id_address
    if _process_vm_readv(pid, iovecs[0].ctypes.data, 1, iovecs[1].ctypes.data, 1, 0) != 8:
        return _NO_CLOCK
    return np.int32(((~iovecs[2, 0]) << 3) | 6)  # CPUCLOCK_SCHED of that thread, per-thread


@numba.njit(nogil=True)
def _sample_holds(
    gil: np.ndarray, native_id_offset: int, pid: int, request: np.ndarray, control: np.ndarray
) -> None:
    """Sample `gil` every `request` until control[_STOP]; keep the window's longest hold.

    control[_HOLDER] gets the native thread id of that hold's holder (0: unknown).

    A hold counts from the window start at the earliest (control[_WINDOW_START]);
    its running time from the first sample after both. The longest values are
    reset here, at the first sample of each window, so a sample taken before
    the window cannot write into it.
    """
    _prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)  # this thread's sleeps end on time (1 ns slack)
    timespec = np.zeros(2, dtype=np.int64)
    iovecs = _read_iovecs()
    held_number = -1  # the switch number of the hold seen in the previous sample
    held_since = holder_clock = holder_id = ran_since = ran_base = 0
    last_sample = _clock_ns(_CLOCK_MONOTONIC, timespec)
    seen_window = -1
    while control[_STOP] == 0:
        control[_LAST_SAMPLE] = last_sample  # the previous sample is fully written
        _nanosleep(request.ctypes.data, 0)
        now = _clock_ns(_CLOCK_MONOTONIC, timespec)
        window_start = control[_WINDOW_START]
        if window_start != seen_window:  # a new window: its longest values start at 0
            seen_window = window_start
            control[_LONGEST_HOLD] = control[_LONGEST_RUNNING] = control[_LONGEST_GAP] = 0
            control[_HOLDER] = 0
        gap = now - max(last_sample, window_start)
        if gap > control[_LONGEST_GAP]:
            control[_LONGEST_GAP] = gap
        last_sample = now
        locked = (gil[_LOCKED] & 0xFFFFFFFF) != 0
        number = np.int64(gil[_SWITCH_NUMBER])
        if not locked:
            held_number = -1
            continue
        if number != held_number:
            held_number, held_since = number, now
            holder = np.int64(gil[_LAST_HOLDER])
            holder_clock = _holder_cpu_clock(pid, holder + native_id_offset, iovecs)
            holder_id = iovecs[2, 0] if holder_clock != _NO_CLOCK else 0
            ran_since = -1  # no running-time base yet
        hold = now - max(held_since, window_start)
        if hold > control[_LONGEST_HOLD]:
            control[_LONGEST_HOLD], control[_HOLDER] = hold, holder_id
        ran = _clock_ns(holder_clock, timespec) if holder_clock != _NO_CLOCK else -1
        if ran < 0:  # the holder's clock cannot be read (the thread has ended)
            continue
        if ran_since < window_start:  # the first base inside the window
            ran_since, ran_base = now, ran
        control[_LONGEST_RUNNING] = max(control[_LONGEST_RUNNING], ran - ran_base)


@numba.njit(nogil=True)
def _sleep_then_stamp(request: np.ndarray, timespec: np.ndarray) -> int:
    """Sleep `request` ([seconds, nanoseconds]), then return the wake-up time in ns.

    Runs without the GIL: the time is when the thread ran again, before it
    asked for the GIL back.
    """
    _nanosleep(request.ctypes.data, 0)
    return _clock_ns(_CLOCK_MONOTONIC, timespec)


def _ask_realtime(granted: list[bool]) -> None:
    """Ask SCHED_FIFO for the calling thread; append whether it was granted."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_FIFO, os.sched_param(1))
    except OSError:  # EPERM without CAP_SYS_NICE
        granted.append(False)
    else:
        granted.append(True)


def _this_thread_state() -> int:
    """The address of the calling thread's PyThreadState."""
    get_thread_state = ctypes.pythonapi.PyThreadState_Get
    get_thread_state.restype = ctypes.c_void_p
    return get_thread_state()


def _native_id_offset() -> int:
    """Byte offset of `native_thread_id` in PyThreadState, found in two threads' states."""

    def offsets(found: list[set[int]]) -> None:
        words = np.ctypeslib.as_array((ctypes.c_uint64 * 64).from_address(_this_thread_state()))
        found.append(set(np.flatnonzero(words == threading.get_native_id()).tolist()))

    found: list[set[int]] = []
    offsets(found)
    other = threading.Thread(target=offsets, args=(found,))
    other.start()
    other.join()
    common = found[0] & found[1]
    if len(common) != 1:
        raise RuntimeError(
            f"GilMonitor: CPython {sys.version.split()[0]}'s thread id was not found in its "
            "thread state"
        )
    return 8 * common.pop()


def _gil_state() -> np.ndarray:
    """uint64 view of this interpreter's GIL state, found in `_PyRuntime` and checked.

    Called with the GIL held: the words (interval, last holder, locked) must
    read (the switch interval, this thread's state, 1), and the interval word
    must follow `sys.setswitchinterval`.
    """
    runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
    words = np.ctypeslib.as_array((ctypes.c_uint64 * 512).from_address(runtime))
    this_thread = _this_thread_state()
    interval = sys.getswitchinterval()
    interval_us = round(interval * 1e6)
    for offset in range(words.size - 3):
        gil = words[offset : offset + 4]
        if (
            gil[_INTERVAL] == interval_us
            and gil[_LAST_HOLDER] == this_thread
            and gil[_LOCKED] & 0xFFFFFFFF == 1
        ):
            sys.setswitchinterval(interval * 2)
            follows = gil[_INTERVAL] == 2 * interval_us
            sys.setswitchinterval(interval)
            if follows:
                return gil
    raise RuntimeError(
        f"GilMonitor: CPython {sys.version.split()[0]}'s GIL state was not found in _PyRuntime"
    )


def _thread_name(native_id: int) -> str:
    """The name of the live thread with `native_id`; "" for 0, "thread <id>" if it has ended."""
    if native_id == 0:
        return ""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    return names.get(native_id, f"thread {native_id}")


@dataclasses.dataclass(frozen=True)
class GilWindow:
    """One timed call: its wall time and what the GIL monitor saw while it ran (seconds)."""

    elapsed: float
    hold: float  # the longest single hold, wall clock (lower bound, see `sample_gap`)
    running: float  # the longest time a holder ran during one hold (its CPU clock)
    wait: float  # the longest wait of a ready thread for the GIL
    sample_gap: float  # the sampler's longest gap between samples: the hold's precision
    holder: str  # the name of the thread that held the longest hold ("" where none was seen)


class GilMonitor:
    """The GIL hold sampler and the wait probe (module docstring), as a context manager."""

    SAMPLE_S = 100e-6
    WAIT_PROBE_S = 200e-6

    def __init__(self) -> None:
        if sys.platform != "linux":
            raise RuntimeError("GilMonitor reads CLOCK_MONOTONIC through libc: Linux only")
        clock = time.get_clock_info("perf_counter").implementation
        if clock != "clock_gettime(CLOCK_MONOTONIC)":
            raise RuntimeError(f"GilMonitor stamps CLOCK_MONOTONIC; perf_counter uses {clock}")
        self._gil = _gil_state()
        self._native_id_offset = _native_id_offset()
        self._control = np.zeros(7, dtype=np.int64)
        self._sample_request = np.array([0, round(self.SAMPLE_S * 1e9)], dtype=np.int64)
        self._wait_request = np.array([0, round(self.WAIT_PROBE_S * 1e9)], dtype=np.int64)
        self._timespec = np.zeros(2, dtype=np.int64)  # the wait probe's struct timespec
        _sleep_then_stamp(self._wait_request, self._timespec)  # compile both before any window
        stopped = np.array([1, 0, 0, 0, 0, 0, 0], dtype=np.int64)
        _sample_holds(self._gil, self._native_id_offset, 0, self._sample_request, stopped)
        self._window_start = time.perf_counter()
        self._longest_wait = 0.0
        self._probe_woke = 0.0  # the wake-up of the latest wait the probe has written
        self._stop = threading.Event()
        self._realtime: list[bool] = []
        self._threads = [
            threading.Thread(target=self._sample_holds, name="gil-sampler", daemon=True),
            threading.Thread(target=self._probe_waits, name="gil-wait-probe", daemon=True),
        ]

    def __enter__(self) -> GilMonitor:
        for thread in self._threads:
            thread.start()
        while len(self._realtime) < len(self._threads):  # both have asked
            time.sleep(self.WAIT_PROBE_S)
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._control[_STOP] = 1
        for thread in self._threads:
            thread.join()

    @property
    def realtime(self) -> bool:
        """Whether both threads run with real-time scheduling (after __enter__)."""
        return len(self._realtime) == len(self._threads) and all(self._realtime)

    def _sample_holds(self) -> None:
        _ask_realtime(self._realtime)
        _sample_holds(
            self._gil, self._native_id_offset, os.getpid(), self._sample_request, self._control
        )

    def _probe_waits(self) -> None:
        _ask_realtime(self._realtime)
        seen_window = None
        while not self._stop.is_set():
            woke = _sleep_then_stamp(self._wait_request, self._timespec) * 1e-9
            window_start = self._window_start
            waited = time.perf_counter() - max(woke, window_start)
            if window_start != seen_window:  # reset here: no earlier wait writes into it
                seen_window, self._longest_wait = window_start, 0.0
            if waited > self._longest_wait:
                self._longest_wait = waited
            self._probe_woke = woke

    def window(self, fn: Callable[[], Any]) -> GilWindow:
        """Call `fn` and report what the monitor saw while it ran."""
        control = self._control
        self._window_start = start = time.perf_counter()
        control[_WINDOW_START] = round(start * 1e9)
        fn()
        end = time.perf_counter()
        self._await_after(end)
        return GilWindow(
            elapsed=end - start,
            hold=control[_LONGEST_HOLD] * 1e-9,
            running=control[_LONGEST_RUNNING] * 1e-9,
            wait=self._longest_wait,
            sample_gap=control[_LONGEST_GAP] * 1e-9,
            holder=_thread_name(int(control[_HOLDER])),
        )

    def _await_after(self, end: float) -> None:
        """Wait (at most 5 s) until both threads have written what they saw up to `end`.

        The sampler has written a sample taken after `end`, and the probe a wait
        that began after it: however late a busy machine runs them, what was
        open at `end` is recorded to `end` at least, and `sample_gap` includes
        the gap that ends a hold's last piece.
        """
        end_ns, deadline = round(end * 1e9), end + 5.0
        while (
            self._control[_LAST_SAMPLE] < end_ns or self._probe_woke < end
        ) and time.perf_counter() < deadline:
            time.sleep(self.SAMPLE_S)

"""Mooncake submit loop: a plan's batches, in order, bounded in time, in either direction.

Push (`MooncakeSender`) writes the plan's sources into the peer's destinations;
pull (`MooncakeReader`) reads the peer's sources into local destinations. The
first failed batch raises `TransferError` (no later batch is submitted); each
engine call runs on its own thread so a stalled peer costs at most
`batch_timeout_s` per batch (`TransferTimeoutError`, its still-running calls in
`in_flight`, at most `max_abandoned_calls` of them per transfer, however many
threads submit); `close()` is final (no engine call starts once it has
returned); batches are split into calls that fit Mooncake's TCP queue.
docs/mooncake.md gives the measured behaviour of Mooncake behind each rule and
when buffers may be reused.
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import math
import numbers
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from itertools import groupby
from operator import attrgetter

from gpu_planner import settings
from gpu_planner.inputs import is_integer
from gpu_planner.integration.mooncake import handoff
from gpu_planner.integration.mooncake.engine import TCP_QUEUE_DEFAULT
from gpu_planner.plan import PlanPiece, TransferPlan
from gpu_planner.profiling import nvtx_range

CallColumns = tuple[handoff.Column, handoff.Column, handoff.Column]  # one engine call


class FromEnvironment(enum.Enum):
    """An argument's default that its knob gives when the transfer is built (docs/settings.md).

    Read then, not at import: a later value applies to transfers built later,
    and a malformed one is a `settings.SettingError` from the constructor.
    """

    DEFAULT = "the environment's value"

    def __repr__(self) -> str:
        return "FROM_ENVIRONMENT"


FROM_ENVIRONMENT = FromEnvironment.DEFAULT


def checked_timeout(name: str, seconds: float | None, *, allow_zero: bool) -> float | None:
    """`seconds` when it is None or a finite number > 0 (or 0) and <= `threading.TIMEOUT_MAX`.

    Python's waits raise `OverflowError` past `TIMEOUT_MAX` (inf included)
    and return at once for NaN, so neither may reach them.
    """
    if seconds is None:
        return None
    least = ">= 0" if allow_zero else "> 0"
    if (
        not isinstance(seconds, numbers.Real)
        or isinstance(seconds, bool)
        or not math.isfinite(seconds)
        or not (seconds > 0 or (allow_zero and seconds == 0))
        or seconds > threading.TIMEOUT_MAX
    ):
        raise ValueError(
            f"{name}: must be a finite number of seconds {least} and at most "
            f"threading.TIMEOUT_MAX ({threading.TIMEOUT_MAX:.0f}), or None for no bound; "
            f"got {seconds!r}"
        )
    return float(seconds)


class TransferError(RuntimeError):
    """A Mooncake batch failed; later batches were never submitted.

    `batch_index`: the failed batch. `confirmed_bytes`: the bytes of every
    call that succeeded before the error (earlier batches, and calls of this
    batch that completed). `in_flight`: futures of this batch's calls still
    running in Mooncake (each resolves to the call's status); the buffers
    must stay valid until all are done. Empty unless the batch timed out.
    """

    def __init__(
        self,
        message: str,
        batch_index: int,
        confirmed_bytes: int,
        in_flight: Iterable[Future[int]] = (),
    ) -> None:
        super().__init__(message)
        self.batch_index = batch_index
        self.confirmed_bytes = confirmed_bytes
        self.in_flight = tuple(in_flight)


class TransferTimeoutError(TransferError):
    """A Mooncake batch did not complete within `batch_timeout_s`; its calls are in `in_flight`."""


class MooncakeTransfer:
    """Submits a plan's batches between the local engine and a peer; stops at the first failure.

    `MooncakeSender` writes and `MooncakeReader` reads; both share this loop
    and its error semantics (see the module docstring). Each batch is one
    call, or consecutive calls of at most `max_call_descriptors` descriptors
    (None: never split). `buffer_workers > 0` submits each batch as one call
    per buffer, up to that many at a time (sglang's custom-memory-pool path);
    the batch completes when all its calls have. `batch_timeout_s` bounds each
    batch (None: no bound, and without buffer workers the calls run on the
    submitting thread). At most `max_abandoned_calls` calls are ever abandoned
    by timed-out batches: each running call of a bounded batch holds one of
    that many slots, and a batch waits (within its own bound) for a slot; while
    abandoned calls hold every slot, each batch is refused before its first
    call. Left at `FROM_ENVIRONMENT`, both are read when the transfer is built,
    from GPU_PLANNER_BATCH_TIMEOUT_S (default 60 s) and
    GPU_PLANNER_MAX_ABANDONED_CALLS (default 16). Batches reach Mooncake
    through a `handoff.Handoff`: descriptor arrays when the engine takes them,
    else lists (`handoff_form`, detected unless given).
    """

    operation = "transfer with"  # how error messages name the direction
    direction: handoff.Direction

    def __init__(
        self,
        engine,
        peer_session_id: str,
        *,
        buffer_workers: int = 0,
        batch_timeout_s: float | None | FromEnvironment = FROM_ENVIRONMENT,
        max_call_descriptors: int | None = TCP_QUEUE_DEFAULT,
        max_abandoned_calls: int | FromEnvironment = FROM_ENVIRONMENT,
        handoff_form: handoff.HandoffForm | None = None,
    ) -> None:
        if batch_timeout_s is FROM_ENVIRONMENT:
            batch_timeout_s = settings.get(settings.BATCH_TIMEOUT_S)
        if max_abandoned_calls is FROM_ENVIRONMENT:
            max_abandoned_calls = settings.get(settings.MAX_ABANDONED_CALLS)
        if buffer_workers < 0:
            raise ValueError(f"buffer_workers: must be >= 0, got {buffer_workers}")
        if max_call_descriptors is not None and max_call_descriptors < 1:
            raise ValueError(
                f"max_call_descriptors: must be >= 1 or None, got {max_call_descriptors}"
            )
        if not is_integer(max_abandoned_calls) or max_abandoned_calls < 1:
            raise ValueError(
                f"max_abandoned_calls: must be an integer >= 1, got {max_abandoned_calls!r}"
            )
        self.engine = engine
        self.peer = peer_session_id
        self.buffer_workers = buffer_workers
        self.batch_timeout_s = checked_timeout("batch_timeout_s", batch_timeout_s, allow_zero=False)
        self.max_call_descriptors = max_call_descriptors
        self.max_abandoned_calls = int(max_abandoned_calls)
        self.handoff = handoff.Handoff.of(engine, self.direction, handoff_form)
        self._lock = threading.Lock()
        self._in_flight: set[Future[int]] = set()  # calls started that have not returned
        self._abandoned: set[Future[int]] = set()  # those of them whose batch timed out
        self._reserved = 0  # slots held by running bounded batches (each may abandon its calls)
        self._slot_freed = threading.Condition(self._lock)  # a slot freed, or closed
        self._closed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self, timeout: float | None = 0.0) -> list[Future[int]]:
        """Start no engine call from now on; the calls still running after `timeout` s.

        Waits at most `timeout` seconds (None: without bound) for the calls in
        flight, whichever thread started them. An empty list means none is
        running, and none will start: the buffers may be reused or
        unregistered. No started call is cancelled (Mooncake cannot stop one).
        """
        timeout = checked_timeout("timeout", timeout, allow_zero=True)
        with self._lock:
            self._closed = True
            self._slot_freed.notify_all()  # batches waiting for a slot see it closed
            in_flight = list(self._in_flight)
        _, running = concurrent.futures.wait(in_flight, timeout=timeout)
        return [call for call in in_flight if call in running]

    def submit(self, plan: TransferPlan) -> int:
        """Submit every batch of `plan`; return the bytes moved. Raises `TransferError`."""
        return self.submit_pieces(self.handoff.pieces(plan, per_buffer=bool(self.buffer_workers)))

    def submit_pieces(self, pieces: Iterable[PlanPiece]) -> int:
        """Submit precomputed pieces in order, each one call (or its slices at the call limit).

        They must be in this transfer's hand-off form (`self.handoff.pieces`).
        The calls of one batch run concurrently, up to `buffer_workers` at a
        time; the next batch starts when all of them have succeeded.
        """
        groups = (list(group) for _, group in groupby(pieces, key=attrgetter("batch")))
        return self._submit_groups(groups)

    def _submit_groups(self, groups: Iterable[list[PlanPiece]]) -> int:
        confirmed = 0
        with nvtx_range(f"{type(self).__name__}/submit"):
            for index, pieces in enumerate(groups):
                with nvtx_range(f"{type(self).__name__}/batch {index}"):
                    confirmed = self._submit_batch(index, self._calls(pieces), confirmed)
        return confirmed

    def _calls(self, pieces: list[PlanPiece]) -> list[CallColumns]:
        """One batch's engine calls: each piece, cut into slices of at most the per-call limit."""
        limit = self.max_call_descriptors
        if limit is not None:
            limit = max(limit // max(self.buffer_workers, 1), 1)  # at most `limit` queued at once
        calls = []
        for piece in pieces:
            count = len(piece.lens)
            if limit is None or count <= limit:
                calls.append((piece.srcs, piece.dsts, piece.lens))
            else:
                calls += [
                    (
                        piece.srcs[at : at + limit],
                        piece.dsts[at : at + limit],
                        piece.lens[at : at + limit],
                    )
                    for at in range(0, count, limit)
                ]
        return calls

    def _submit_batch(self, index: int, calls: list[CallColumns], confirmed: int) -> int:
        """Run one batch's calls within the batch timeout; the bytes confirmed after it.

        At most `buffer_workers` (or one) run at a time, and no more than the
        slots the batch holds (`_reserve`), started in order, and none starts
        once a call has failed or found the transfer closed. Raises
        `TransferError`; re-raises at once what is not an `Exception`.
        """
        timeout = self.batch_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        slots = self._reserve(index, len(calls), deadline, confirmed)
        try:
            return self._run_calls(index, calls, confirmed, slots, deadline)
        finally:
            self._release(slots)

    def _reserve(self, index: int, calls: int, deadline: float | None, confirmed: int) -> int:
        """Slots for the calls of batch `index` that may run at once (each may be abandoned).

        The cap check and the reservation are one step under the lock: running
        calls of bounded batches and abandoned calls together never exceed
        `max_abandoned_calls`, however many threads submit, so neither do the
        abandoned ones. Waits for a free slot until `deadline`; raises
        `TransferError` at once while abandoned calls hold every slot (a
        stalled peer), when the transfer is closed, or at the deadline. An
        unbounded batch (no deadline) abandons nothing and takes no slot.
        """
        wanted = min(calls, max(self.buffer_workers, 1))
        if deadline is None:
            return wanted
        with self._slot_freed:
            while True:
                abandoned = len(self._abandoned)
                if abandoned >= self.max_abandoned_calls:
                    raise self._refused(
                        index,
                        f"{abandoned} abandoned calls of timed-out batches are still running "
                        "in Mooncake (is the peer stalled?)",
                        confirmed,
                    )
                if self._closed:
                    raise self._closed_error(index, calls, calls, confirmed)
                free = self.max_abandoned_calls - abandoned - self._reserved
                if free > 0:
                    slots = min(wanted, free)
                    self._reserved += slots
                    return slots
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._refused(
                        index,
                        f"no call slot freed within {self.batch_timeout_s} s ({abandoned} "
                        f"abandoned calls, {self._reserved} running in other batches)",
                        confirmed,
                    )
                self._slot_freed.wait(remaining)

    def _release(self, slots: int) -> None:
        """Give back a batch's slots; its abandoned calls count as abandoned until they end."""
        if self.batch_timeout_s is not None:
            with self._slot_freed:
                self._reserved -= slots
                self._slot_freed.notify_all()

    def _refused(self, index: int, why: str, confirmed: int) -> TransferError:
        """The `TransferError` of a batch refused before its first call, for `why`."""
        return TransferError(
            f"Mooncake batch {index} ({self.operation} {self.peer}) refused: {why}, "
            f"max_abandoned_calls={self.max_abandoned_calls}; batches are accepted again once "
            f"the abandoned calls end; {confirmed} bytes were confirmed before",
            batch_index=index,
            confirmed_bytes=confirmed,
        )

    def _closed_error(
        self, index: int, not_started: int, calls: int, confirmed: int
    ) -> TransferError:
        """The `TransferError` of a batch that found the transfer closed."""
        return TransferError(
            f"Mooncake batch {index} ({self.operation} {self.peer}): the transfer was "
            f"closed; {not_started} of its {calls} calls were not started; "
            f"{confirmed} bytes were confirmed before, later batches not submitted",
            batch_index=index,
            confirmed_bytes=confirmed,
        )

    def _run_calls(
        self,
        index: int,
        calls: list[CallColumns],
        confirmed: int,
        slots: int,
        deadline: float | None,
    ) -> int:
        """`_submit_batch`'s loop: at most `slots` calls running, all done by `deadline`."""
        waiting = collections.deque(calls)
        running: dict[Future[int], CallColumns] = {}
        failed: tuple[Future[int], CallColumns] | None = None
        refused = 0  # calls that found the transfer closed
        while True:
            while waiting and failed is None and not refused and len(running) < slots:
                call = waiting.popleft()
                running[self._start(call)] = call
            if not running:
                break
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            done, _ = concurrent.futures.wait(
                running, timeout=remaining, return_when=concurrent.futures.FIRST_COMPLETED
            )
            if not done:
                with self._lock:  # those still running: a call that returned is not abandoned
                    self._abandoned |= self._in_flight.intersection(running)
                raise TransferTimeoutError(
                    f"Mooncake batch {index} ({self.operation} {self.peer}): {len(running)} of "
                    f"{len(calls)} calls still running after {self.batch_timeout_s} s (is the "
                    f"peer stalled?) and {len(waiting)} not started; the running ones keep "
                    f"writing until Mooncake ends them (see in_flight); {confirmed} bytes were "
                    "confirmed before, later batches not submitted",
                    batch_index=index,
                    confirmed_bytes=confirmed,
                    in_flight=running,
                )
            for future in done:
                call = running.pop(future)
                if future.cancelled():  # it found the transfer closed: never started
                    refused += 1
                    continue
                error = future.exception()
                if error is not None and not isinstance(error, Exception):
                    raise error  # KeyboardInterrupt, SystemExit: not the engine's failure
                if error is None and future.result() == 0:
                    confirmed += handoff.column_total(call[2])
                elif failed is None:
                    failed = future, call
        if failed is not None:
            raise self._failure(index, *failed, confirmed)
        if refused:
            raise self._closed_error(index, refused + len(waiting), len(calls), confirmed)
        return confirmed

    def _failure(
        self, index: int, future: Future[int], call: CallColumns, confirmed: int
    ) -> TransferError:
        """The `TransferError` for a call that returned a non-zero status or raised."""
        error = future.exception()
        outcome = (
            f"status {future.result()}" if error is None else f"{type(error).__name__}: {error}"
        )
        failure = TransferError(
            f"Mooncake batch {index} ({self.operation} {self.peer}) failed with {outcome} (a "
            f"call of {len(call[2])} descriptors, {handoff.column_total(call[2])} bytes); "
            f"{confirmed} bytes were confirmed before, later batches not submitted",
            batch_index=index,
            confirmed_bytes=confirmed,
        )
        failure.__cause__ = error
        return failure

    def _start(self, call: CallColumns) -> Future[int]:
        """Run one engine call on a thread of its own (on this one when nothing is bounded).

        A thread per call means no call ever waits for another submit's worker.
        """
        future: Future[int] = Future()
        if self.batch_timeout_s is None and not self.buffer_workers:
            self._run(future, call)
        else:
            name = f"gpu-planner-mooncake-{self.operation.split()[0]}"
            threading.Thread(target=self._run, args=(future, call), name=name, daemon=True).start()
        return future

    def _run(self, future: Future[int], call: CallColumns) -> None:
        """Call the engine unless the transfer is closed (then cancel `future`); resolve it.

        The closed check and the registration as running are one step under
        the lock `close` takes, so `close` sees every call that may still
        reach Mooncake. A call leaves the running set before its future
        resolves: whoever wakes on it sees it gone.
        """
        with self._lock:
            if self._closed:
                future.cancel()
                future.set_running_or_notify_cancel()  # cancelled, and done for its waiters
                return
            future.set_running_or_notify_cancel()
            self._in_flight.add(future)
        try:
            status = self._call(*call)
        except BaseException as error:  # the submitting thread raises it (or its TransferError)
            self._forget(future)
            future.set_exception(error)
        else:
            self._forget(future)
            future.set_result(status)

    def _forget(self, future: Future[int]) -> None:
        """`future`'s call has returned: no longer running, and an abandoned one frees its slot."""
        with self._lock:
            self._in_flight.discard(future)
            if future in self._abandoned:
                self._abandoned.discard(future)
                self._slot_freed.notify_all()

    def _call(self, srcs: handoff.Column, dsts: handoff.Column, lens: handoff.Column) -> int:
        """One Mooncake call for (srcs, dsts, lens) in the plan's convention; its status."""
        return self.handoff.call(self.peer, srcs, dsts, lens)


class MooncakeSender(MooncakeTransfer):
    """Push: writes the plan's sources (local memory) into its destinations (the peer's)."""

    operation = "write to"
    direction = "write"


class MooncakeReader(MooncakeTransfer):
    """Pull: reads the plan's sources (the peer's memory) into its destinations (local)."""

    operation = "read from"
    direction = "read"

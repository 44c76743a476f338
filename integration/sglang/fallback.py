"""The sglang hooks' contract, enforced in one place: `around`.

A hook runs inside sglang's transfer worker, whose thread ends for good on
any exception a send raises. So whatever a hook does, exactly one of these
leaves it:

(a) sglang's status for a send it completed (or that sglang itself would
    have refused without transferring: the hook raises `Failed(status)`);
(b) sglang's own code, run on the same arguments, when no engine call had
    started: the hook raised `Fallback(reason)`, or any other `Exception`
    (a partial manager, a device error, a bug), counted and logged once per
    reason;
(c) -1, once an engine call had started, after every task the hook submitted
    has ended (queued ones cancelled): a failed send, as sglang reports one,
    counted and logged once per reason. Never a fallback after a byte moved.
    Nor for a send sglang's code cannot serve (`SendProgress.refuse_fallback`:
    a decode of another page size, `page_sizes`): what would fall back is -1.

A `BaseException` that is not an `Exception` (interrupt, exit) propagates.
What a call started is tracked by its `SendProgress` (`current_send()`):
the adapter marks each engine call there, and the hooks keep their executor
futures there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import threading
from collections.abc import Callable, Iterator

from gpu_planner.integration.sglang.counters import record_failure, record_fallback

logger = logging.getLogger("gpu_planner.integration.sglang.plugin")

FAILED_SEND = -1  # sglang's status for a failed transfer

_logged_keys: set[str] = set()
_logged_lock = threading.Lock()


class Fallback(Exception):
    """Run sglang's original for this call, for `reason` (counted and logged once per `key`)."""

    def __init__(self, reason: str, key: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.key = reason if key is None else key


class Failed(Exception):
    """Return `status` for this call, as sglang returns it without transferring."""

    def __init__(self, status: int = FAILED_SEND) -> None:
        super().__init__(status)
        self.status = status


class SendProgress:
    """What one hooked call has started: engine calls, and the executor tasks that make them."""

    def __init__(self) -> None:
        self.futures: list[concurrent.futures.Future] = []
        self.no_fallback: str | None = None  # why sglang's own code cannot run this call
        self._engine_calls = 0
        self._lock = threading.Lock()

    def refuse_fallback(self, why: str) -> None:
        """sglang's code cannot serve this call (`why`): a fallback becomes a failed send."""
        self.no_fallback = why

    def engine_call_starting(self) -> None:
        """Called (from any thread) right before an engine call: bytes may move from now on."""
        with self._lock:
            self._engine_calls += 1

    @property
    def engine_called(self) -> bool:
        with self._lock:
            return self._engine_calls > 0

    def settle(self) -> None:
        """Cancel the tasks not started and wait for the others to end.

        A cancelled task counts as done only once a worker dequeues it, so only
        the ones that could not be cancelled are waited for.
        """
        running = [future for future in self.futures if not future.cancel()]
        concurrent.futures.wait(running)


_current_send: contextvars.ContextVar[SendProgress | None] = contextvars.ContextVar(
    "gpu_planner_send", default=None
)


def current_send() -> SendProgress:
    """The progress of the hooked call running in this thread (a fresh one outside `around`)."""
    progress = _current_send.get()
    return SendProgress() if progress is None else progress


def log_once(level: int, message: str, key: str, error: Exception | None = None) -> None:
    """Log `message` the first time `key` comes, in this process."""
    if key in _logged_keys:  # keys are only added: a set read, no lock, for every later time
        return
    with _logged_lock:
        if key in _logged_keys:
            return
        _logged_keys.add(key)
    logger.log(level, message, exc_info=error)


def log_fallback_once(reason: str, key: str | None = None) -> None:
    """Count every fallback by `key` (default: the reason); log `reason` at INFO the first time."""
    key = reason if key is None else key
    record_fallback(key)
    log_once(logging.INFO, f"gpu_planner: falling back to sglang's original code: {reason}", key)


@contextlib.contextmanager
def best_effort(what: str, key: str) -> Iterator[None]:
    """Run the block; an exception out of it is counted and logged once (`what (error)`), never
    raised: for a hook that adds to sglang's own result and returns that result either way."""
    try:
        yield
    except Exception as error:
        log_fallback_once(f"{what} ({error})", key=key)


def around(hook: Callable) -> Callable:
    """`hook` as an AROUND hook for sglang's HookRegistry: `(original, *args, **kwargs)`."""
    name = hook.__name__

    @functools.wraps(hook)
    def run(original: Callable, *args, **kwargs):
        progress = SendProgress()
        token = _current_send.set(progress)
        try:
            return hook(*args, **kwargs)
        except Failed as failed:
            outcome = failed.status, "", "", None
        except Fallback as fallback:
            outcome = None, fallback.reason, fallback.key, None
        except Exception as error:  # the contract: nothing but (a)-(c) leaves a hook
            reason = f"{name} raised {type(error).__name__}: {error}"
            outcome = None, reason, f"{name}: {type(error).__name__}", error
        finally:
            _current_send.reset(token)
        status, reason, key, unexpected = outcome
        progress.settle()
        if status is not None:
            return status
        if progress.engine_called or progress.no_fallback:
            when = (
                "after its first engine call"
                if progress.engine_called
                else f"where sglang's code cannot serve it ({progress.no_fallback})"
            )
            with contextlib.suppress(Exception):  # a broken metrics folder must not escape
                record_failure(key)
                log_once(
                    logging.ERROR,
                    f"gpu_planner: a send failed {when} ({reason}); "
                    "sglang gets -1, as for any failed transfer",
                    f"failed: {key}",
                    unexpected,
                )
            return FAILED_SEND
        with contextlib.suppress(Exception):  # nor stop sglang's own code from running
            if unexpected:
                log_once(
                    logging.WARNING, f"gpu_planner: {reason}", f"unexpected: {key}", unexpected
                )
            log_fallback_once(reason, key)
        return original(*args, **kwargs)

    return run

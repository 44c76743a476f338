"""The sglang hooks' one convention for "run sglang's own code" and "return sglang's status".

A hook runs with the target's own arguments. Where it cannot do the call the
way sglang would (an input the planner does not model), it raises `Fallback`
with the reason, before any byte moves; `around` logs each reason once,
counts it, and runs the original. Where sglang itself would return a status
without transferring (it has logged and, where it does, concluded the
request), a hook's helper raises `Failed` and `around` returns that status.
Everything else, engine statuses included, the hook returns as sglang would.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

from gpu_planner.integration.sglang.counters import record_fallback

logger = logging.getLogger("gpu_planner.integration.sglang.plugin")

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

    def __init__(self, status: int = -1) -> None:
        super().__init__(status)
        self.status = status


def log_fallback_once(reason: str, key: str | None = None) -> None:
    """Count every fallback by `key` (default: the reason); log `reason` at INFO the first time."""
    key = reason if key is None else key
    record_fallback(key)
    with _logged_lock:
        if key in _logged_keys:
            return
        _logged_keys.add(key)
    logger.info("gpu_planner: falling back to sglang's original code: %s", reason)


def around(hook: Callable) -> Callable:
    """`hook` as an AROUND hook for sglang's HookRegistry: `(original, *args, **kwargs)`."""

    @functools.wraps(hook)
    def run(original: Callable, *args, **kwargs):
        try:
            return hook(*args, **kwargs)
        except Fallback as fallback:
            log_fallback_once(fallback.reason, fallback.key)
            return original(*args, **kwargs)
        except Failed as failed:
            return failed.status

    return run

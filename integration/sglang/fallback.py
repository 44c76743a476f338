"""Log each reason the sglang plugin hands a call back to sglang's own code, once."""

from __future__ import annotations

import logging
import threading

from gpu_planner.integration.sglang.counters import record_fallback

logger = logging.getLogger("gpu_planner.integration.sglang.plugin")

_logged_keys: set[str] = set()
_logged_lock = threading.Lock()


def log_fallback_once(reason: str, key: str | None = None) -> None:
    """Count every fallback by `key` (default: the reason); log `reason` at INFO the first time."""
    key = reason if key is None else key
    record_fallback(key)
    with _logged_lock:
        if key in _logged_keys:
            return
        _logged_keys.add(key)
    logger.info("gpu_planner: falling back to sglang's original code: %s", reason)

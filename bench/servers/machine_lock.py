"""One deployment of real servers at a time on a machine, across processes: a file lock.

The receive-staging deployment alone takes about 10 GiB at its peak (PSS; 5 of its 7
servers at once, in two phases); two suites (or a suite and `bench.deployment`)
starting theirs at once on one machine exhaust its memory, and the OOM killer ends
both. `servers_running` holds this
lock for a deployment's whole lifetime, so a second deployment waits (saying so
on stderr, with the holder's pid) until the first has stopped. The lock is
`flock` on `LOCK_PATH`, a fixed path rather than the temporary folder
(`TMPDIR` may differ between two suites), or on the file that
`GPU_PLANNER_SERVERS_LOCK` names (a machine with room for two deployments, a
test of the lock itself): the kernel releases it when its holder exits,
SIGKILL included, so a dead suite never blocks the next.

It is held per process: a deployment started while the same process already
holds the lock (the router started in front of its servers, a session's
reference server started inside a module's deployment) goes ahead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_PATH = Path("/tmp/gpu_planner-servers.lock")
LOCK_ENV = "GPU_PLANNER_SERVERS_LOCK"

_guard = threading.Lock()
_depth: dict[Path, int] = {}  # lock path -> how many blocks of this process hold it


def _open(path: Path) -> int:
    """The lock file, created readable and writable by every user (one machine, one lock)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:  # another user's file in /tmp (sticky): a shared lock works on it too
        return os.open(path, os.O_RDONLY)
    with contextlib.suppress(PermissionError):
        os.fchmod(fd, 0o666)  # past the umask
    return fd


def _holder(fd: int) -> str:
    """What the holder wrote into the lock file: its pid and what it runs."""
    with contextlib.suppress(OSError):
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
    return "unknown"


@contextlib.contextmanager
def machine_lock(what: str, path: Path | None = None) -> Iterator[None]:
    """Hold the machine's deployment lock around the block, waiting for another process's.

    `what` names this holder in the lock file and in another waiter's message.
    """
    path = Path(path or os.environ.get(LOCK_ENV) or LOCK_PATH)
    with _guard:
        nested = path in _depth
        if nested:
            _depth[path] += 1
    if nested:
        try:
            yield
        finally:
            with _guard:
                _depth[path] -= 1
        return
    fd = _open(path)
    try:
        _acquire(fd, what, path)
        with _guard:
            _depth[path] = 1
        try:
            yield
        finally:
            with _guard:
                del _depth[path]
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _acquire(fd: int, what: str, path: Path) -> None:
    """flock `fd`; when another process holds it, say so and wait. Then name this holder."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        waited = time.monotonic()
        print(
            f"gpu_planner servers: {what} waits for another deployment on this machine "
            f"(lock {path}, held by {_holder(fd)})",
            file=sys.stderr,
            flush=True,
        )
        fcntl.flock(fd, fcntl.LOCK_EX)
        print(
            f"gpu_planner servers: {what} got the lock after {time.monotonic() - waited:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    with contextlib.suppress(OSError):  # a read-only descriptor: the holder stays unnamed
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {what}\n".encode(), 0)

"""A server's keeper: run its command, and kill its whole process group when the launcher dies.

`python -I watchdog.py LAUNCHER_PID -- COMMAND...`: the launcher
(`bench.servers.launcher.start`) starts this script as the leader of a new
process group (`start_new_session`); the script runs COMMAND (the server) as
its child in that group, where the server's own children (sglang's scheduler
and detokenizer) stay too. Every `POLL_S` it checks its parent: once that is no
longer LAUNCHER_PID (the launcher died, even of SIGKILL, and this process was
handed to init or a subreaper), it SIGKILLs its group, itself included, so no
server outlives the process that started it. It polls rather than ask the
kernel for `PR_SET_PDEATHSIG`: that signal fires when the launcher's *thread*
that forked exits, not its process, and would only reach this process, not
the group.

The group is signalled as before: SIGTERM to the group reaches the server,
which shuts down; this script ignores SIGTERM and exits once the server has,
with the server's status (a signal that killed the server kills this script
too), so the launcher's `Popen` reads the server's exit as if it had started
it itself. Standard library only, run with `-I` (no PYTHONPATH, not the
script's folder, on its path): it imports nothing of the repository.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

POLL_S = 0.2


def keep(launcher: int, command: list[str]) -> int:
    """Run `command` until it exits (its status) or `launcher` is gone (the group is killed)."""
    if os.getppid() != launcher:  # died before this process got here
        os.killpg(0, signal.SIGKILL)
    # A no-op handler, not SIG_IGN: the server (exec'd) gets SIGTERM's default action back.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server = subprocess.Popen(command)
    while True:
        try:
            return server.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            if os.getppid() != launcher:
                print(
                    f"watchdog: launcher {launcher} is gone; killing process group {os.getpgid(0)}",
                    file=sys.stderr,
                    flush=True,
                )
                os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> None:
    launcher, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: watchdog.py LAUNCHER_PID -- COMMAND...")
    status = keep(int(launcher), command)
    if status < 0:  # the server died of a signal: so does its keeper, for the launcher to see
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        status = 128 - status  # a signal whose default is not to terminate
    sys.exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])

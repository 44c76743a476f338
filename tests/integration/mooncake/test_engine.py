"""`engine_process`: a peer engine's process, forked from a server that imported Mooncake once."""

from __future__ import annotations

import multiprocessing
import os
import sys

from gpu_planner.integration.mooncake.engine import ENGINE_PROCESS_PRELOAD, engine_process

VARIABLE = "GPU_PLANNER_TEST_ENGINE_PROCESS"


def _report(connection, tag: str) -> None:
    """The child: what it found, on the pipe and on its stdout and stderr."""
    preloaded = [name for name in ENGINE_PROCESS_PRELOAD if name in sys.modules]
    connection.send((os.environ.get(VARIABLE), preloaded, os.getppid()))
    print(f"stdout of {tag}", flush=True)
    print(f"stderr of {tag}", file=sys.stderr, flush=True)


def _run(tag: str) -> tuple[str | None, list[str], int]:
    connection, child_end = multiprocessing.Pipe()
    process = engine_process(_report, (child_end, tag))
    process.start()
    child_end.close()
    assert connection.poll(60), "the child sent nothing"
    found = connection.recv()
    process.join(60)
    assert process.exitcode == 0
    assert process.daemon
    return found


def test_each_child_has_the_environment_and_output_of_its_start_and_the_preloaded_modules(
    monkeypatch, capfd
):
    monkeypatch.setenv(VARIABLE, "first")
    environment, preloaded, parent = _run("first")
    assert environment == "first"
    assert preloaded == list(ENGINE_PROCESS_PRELOAD)  # imported before the fork, not by the child
    assert parent != os.getpid()  # forked from the server, not from this process
    first = capfd.readouterr()
    assert "stdout of first" in first.out and "stderr of first" in first.err
    monkeypatch.setenv(VARIABLE, "second")  # after the server started: the second child sees it
    environment, _, second_parent = _run("second")
    assert (environment, second_parent) == ("second", parent)  # the same server, forking again
    second = capfd.readouterr()  # capfd's files now, not those of the first test's capture
    assert "stdout of second" in second.out and "stderr of second" in second.err
    assert "first" not in second.out + second.err

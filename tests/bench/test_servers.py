"""The server launcher (`bench.servers`) without sglang: a server's lifetime, its environment,
and the machine's deployment lock, with small fake servers (a Python HTTP server that spawns a
child), each test in a few seconds."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.servers import launcher, machine_lock
from bench.servers.launcher import (
    CPU_SCAFFOLDING,
    ServerSpec,
    server_env,
    servers_running,
    start,
    stop_all,
)

ROOT = Path(__file__).resolve().parents[2]

# A server: a child process in its group (sglang's scheduler), its pids in $FAKE_PIDS, 200 on GET.
FAKE_SERVER = textwrap.dedent("""
    import http.server, os, pathlib, signal, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    signal.signal(signal.SIGTERM, lambda *_: (child.terminate(), child.wait(), sys.exit(0)))
    pids = pathlib.Path(os.environ["FAKE_PIDS"])
    pids.with_suffix(".tmp").write_text(f"{os.getpid()} {child.pid}")
    pids.with_suffix(".tmp").rename(pids)
    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
        def log_message(self, *args):
            pass
    port = int(sys.argv[sys.argv.index("--port") + 1])
    http.server.HTTPServer(("127.0.0.1", port), Ok).serve_forever()
""")

# A launcher that starts one fake server, says so, and waits to be killed.
LAUNCHER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from bench.servers.launcher import ServerSpec, servers_running
    log_dir, pids, fake = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    spec = ServerSpec("fake", (), (("FAKE_PIDS", pids),), (sys.executable, "-c", fake))
    with servers_running([spec], log_dir) as servers:
        print(servers["fake"].process.pid, flush=True)
        time.sleep(600)
""")

# Holds the lock until told to let go: `lock marker release what`.
HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from bench.servers.machine_lock import machine_lock
    lock, marker, release = map(Path, sys.argv[1:4])
    with machine_lock(sys.argv[4], lock):
        marker.touch()
        while not release.exists():
            time.sleep(0.02)
""")

# Exit 0 if the lock is free now (taken and let go at once), 1 if another process holds it.
TRY_LOCK = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(1)
""")


def _python(source: str, *args: object, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", source, *map(str, args)], env=env, **kwargs)


def _gone(pid: int) -> bool:
    """No such process, or a zombie (this machine's init may never reap an orphan)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def _wait_for(condition, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.02)


def _fake_spec(pids: Path) -> ServerSpec:
    return ServerSpec("fake", (), (("FAKE_PIDS", str(pids)),), (sys.executable, "-c", FAKE_SERVER))


def _lock_free(lock: Path) -> bool:
    return _python(TRY_LOCK, lock).wait() == 0


@pytest.fixture
def lock_file(tmp_path, monkeypatch) -> Path:
    """A lock of this test's own (never the machine's: a suite may be running beside it)."""
    path = tmp_path / "servers.lock"
    monkeypatch.setenv(machine_lock.LOCK_ENV, str(path))
    return path


def test_a_server_and_its_child_die_when_the_launcher_is_sigkilled(tmp_path, lock_file):
    pids = tmp_path / "pids"
    launcher = _python(LAUNCHER, tmp_path, pids, FAKE_SERVER, stdout=subprocess.PIPE, text=True)
    keeper = None
    try:
        keeper = int(launcher.stdout.readline())  # once the server is ready
        server, child = map(int, pids.read_text().split())
        assert not any(map(_gone, (keeper, server, child)))
        assert not _lock_free(lock_file)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        _wait_for(
            lambda: all(map(_gone, (keeper, server, child))),
            what="the keeper, the server and its child gone after the launcher's SIGKILL",
        )
        assert _lock_free(lock_file)
        log = (tmp_path / "fake.log").read_text()
        assert f"launcher {launcher.pid} is gone; killing process group {keeper}" in log
    finally:
        launcher.kill()
        launcher.wait()
        if keeper is not None:  # the test failed: leave no server behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(keeper, signal.SIGKILL)


def test_stop_ends_the_server_and_its_child_and_the_keeper_reports_their_exit(tmp_path):
    pids = tmp_path / "pids"
    server = start(_fake_spec(pids), tmp_path / "fake.log")
    _wait_for(pids.exists, what="the fake server's pids")
    leader, child = map(int, pids.read_text().split())
    assert os.getpgid(leader) == os.getpgid(child) == server.process.pid  # the keeper's group
    server.stop()
    assert server.process.returncode == 0  # the server's own status, through its keeper
    assert _gone(leader) and _gone(child)


def test_a_stopped_or_killed_server_is_not_signalled_again(tmp_path, monkeypatch):
    """A deployment stops some servers early and all at its end: the second stop (or a stop
    after a kill) sends nothing to a group id that may lead another group by then."""
    servers = [start(_fake_spec(tmp_path / name), tmp_path / f"{name}.log") for name in "ab"]
    servers[0].stop()
    servers[1].kill()
    signalled = []
    monkeypatch.setattr(os, "killpg", lambda group, sig: signalled.append((group, sig)))
    for server in servers:
        server.stop()
        server.kill()
    assert signalled == []


def test_stop_all_gives_every_server_one_shared_grace(tmp_path, monkeypatch):
    """Servers that ignore SIGTERM (as sglang outlasts the grace) stop in one grace together,
    not one each: every group gets SIGTERM before the first SIGKILL, and all are killed; an
    already stopped one is not signalled again."""
    grace_s = 1.5
    monkeypatch.setattr(launcher, "STOP_GRACE_S", grace_s)
    deaf = (
        "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "pathlib.Path(sys.argv[1]).touch(); time.sleep(600)"
    )
    deaf_now = [tmp_path / f"deaf{index}.ignoring" for index in range(4)]
    servers = [
        start(
            ServerSpec("deaf", (), command=(sys.executable, "-c", deaf, str(marker))),
            tmp_path / f"deaf{index}.log",
        )
        for index, marker in enumerate(deaf_now)
    ]
    servers[0].stop()
    _wait_for(lambda: all(marker.exists() for marker in deaf_now[1:]), what="SIGTERM ignored")
    signalled = []
    send = os.killpg

    def recorded(group: int, sig: int) -> None:
        if sig:  # not a probe
            signalled.append((sig, group))
        send(group, sig)

    monkeypatch.setattr(os, "killpg", recorded)
    began = time.monotonic()
    stop_all(servers)
    assert time.monotonic() - began >= grace_s  # the grace ran out: none of them exited
    groups = [server.process.pid for server in servers[1:]]
    assert signalled == [(signal.SIGTERM, group) for group in groups] + [
        (signal.SIGKILL, group) for group in groups
    ]
    assert all(server.stopped for server in servers)
    assert [server.process.returncode for server in servers[1:]] == [-signal.SIGKILL] * 3


@pytest.mark.parametrize(
    ("source", "status"),
    [("import sys; sys.exit(3)", 3), ("import os; os.kill(os.getpid(), 9)", -signal.SIGKILL)],
)
def test_the_keeper_exits_as_the_server_did(tmp_path, source, status):
    spec = ServerSpec("exits", (), command=(sys.executable, "-c", source))
    server = start(spec, tmp_path / "exits.log")
    assert server.process.wait(timeout=30) == status


def test_a_server_that_exits_during_start_up_fails_the_deployment_and_frees_the_lock(
    tmp_path, lock_file
):
    spec = ServerSpec("exits", (), command=(sys.executable, "-c", "import sys; sys.exit(3)"))
    with (
        pytest.raises(RuntimeError, match="exits exited with 3 during start-up"),
        servers_running([spec], tmp_path),
    ):
        pass
    assert _lock_free(lock_file)


def test_servers_running_holds_the_machine_lock_for_the_deployment(tmp_path, lock_file):
    inner = tmp_path / "inner"
    inner.mkdir()
    with servers_running([_fake_spec(tmp_path / "pids")], tmp_path):
        assert not _lock_free(lock_file)
        # A deployment inside another of the same process (the router) does not wait for it.
        with servers_running([_fake_spec(inner / "pids")], inner):
            assert not _lock_free(lock_file)
        assert not _lock_free(lock_file)
    assert _lock_free(lock_file)


@pytest.fixture
def holder(tmp_path):
    """Start a process that holds `lock` as `what` until `<name>-go` exists (killed at the end);
    it touches `<name>` once it holds the lock."""
    started = []

    def start_holder(lock: Path, name: str, what: str, **kwargs) -> subprocess.Popen:
        process = _python(HOLDER, lock, tmp_path / name, tmp_path / f"{name}-go", what, **kwargs)
        started.append(process)
        return process

    yield start_holder
    for process in started:
        process.kill()
        process.wait()


def test_a_second_process_waits_for_the_lock_and_says_who_holds_it(tmp_path, holder):
    lock, err = tmp_path / "servers.lock", tmp_path / "second.err"
    first = holder(lock, "first", "suite A")
    _wait_for((tmp_path / "first").exists, what="the first holder")
    with err.open("w") as stream:
        second = holder(lock, "second", "suite B", stderr=stream)
    _wait_for(lambda: "waits" in err.read_text(), what="a wait line")
    assert f"suite B waits for another deployment on this machine (lock {lock}" in err.read_text()
    assert f"held by pid {first.pid}: suite A" in err.read_text()
    time.sleep(0.5)
    assert not (tmp_path / "second").exists()  # still waiting
    (tmp_path / "first-go").touch()
    assert first.wait(timeout=30) == 0
    _wait_for((tmp_path / "second").exists, what="the second holder's turn")
    (tmp_path / "second-go").touch()
    assert second.wait(timeout=30) == 0
    assert "suite B got the lock after" in err.read_text()


def test_a_holder_killed_by_sigkill_lets_the_next_one_in(tmp_path, holder):
    lock = tmp_path / "servers.lock"
    first = holder(lock, "first", "suite A")
    _wait_for((tmp_path / "first").exists, what="the first holder")
    second = holder(lock, "second", "suite B", stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    assert not (tmp_path / "second").exists()
    first.send_signal(signal.SIGKILL)
    first.wait()
    _wait_for((tmp_path / "second").exists, what="the second holder's turn")
    (tmp_path / "second-go").touch()
    assert second.wait(timeout=30) == 0


def test_the_lock_nests_within_one_process(tmp_path, capsys):
    lock = tmp_path / "servers.lock"
    with machine_lock.machine_lock("outer", lock):
        with machine_lock.machine_lock("inner", lock):
            assert not _lock_free(lock)
        assert not _lock_free(lock)  # the inner block's end keeps the outer's hold
    assert _lock_free(lock)
    assert "waits" not in capsys.readouterr().err


def test_a_servers_path_has_the_cpu_scaffolding_and_nothing_of_the_test_tree(tmp_path):
    env = server_env(ServerSpec("plain", ()), tmp_path)
    probe = (
        "import importlib.metadata as m, sgl_kernel, sys; print(sgl_kernel.__file__); "
        "print(sorted(e.name for e in m.entry_points(group='sglang.srt.plugins')))"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert Path(found[0]).is_relative_to(CPU_SCAFFOLDING)
    assert "sglang_cpu_scaffolding" in found[1]
    assert not any(
        Path(folder).resolve().is_relative_to(ROOT / "tests")
        for folder in env["PYTHONPATH"].split(os.pathsep)
    )

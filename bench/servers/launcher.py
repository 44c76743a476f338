"""Real sglang 0.5.23 servers on this CPU machine: prefill, decode, plain, and the `smg` router.

The one launcher of real servers: `bench.deployment` and the e2e suite
(`tests/e2e`) both start theirs here. Every server is started in its own
process group (`start_new_session`) under its keeper (`watchdog.py`), with its
output in a log file, and stopped by signalling the whole group (SIGTERM, then
SIGKILL after a grace period): sglang's scheduler and detokenizer processes go
with it. `servers_running` stops every server it started (together: `stop_all`),
also when start-up or a test fails, and keeps the logs. A server never outlives the process that
started it: when that process dies without stopping it (SIGKILL, the OOM
killer), the keeper kills the server's group within a fraction of a second.
And one deployment runs at a time on a machine: `servers_running` holds the
machine's lock (`machine_lock`) for its deployment's lifetime, so a second
suite's deployment waits for the first's instead of exhausting the memory.

sglang's CPU path needs scaffolding (`cpu_scaffolding/`, put on every server's
PYTHONPATH; nothing is installed): a stand-in `sgl_kernel` and a sglang plugin
that turns off what needs CUDA. Whatever else the launching process has on its
PYTHONPATH reaches the servers too (the e2e suite's test-only controls). The
flags below are what sglang 0.5.23 needs on a CPU machine:
`SGLANG_USE_CPU_ENGINE=1` with the torch-native attention backend, no CUDA
graphs, no overlap scheduler (a prefix-cache hit under it records a CUDA
event), and on decode no retraction backup (it calls `torch.cuda.cudart()`).
`--sleep-on-idle` parks a scheduler with nothing queued in a poll of its
request sockets: otherwise every idle server's scheduler spins a core, and
servers sharing 2 cores slow each other several-fold.
The model runs without a tokenizer (`--skip-tokenizer-init`): requests carry
token ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import requests

from bench.servers.machine_lock import machine_lock

LOCALHOST = "127.0.0.1"
CPU_SCAFFOLDING = Path(__file__).resolve().parent / "cpu_scaffolding"
WATCHDOG = Path(__file__).resolve().parent / "watchdog.py"
START_TIMEOUT_S = 480.0  # 30-75 s alone; several servers (a TP 2 one: 4 processes) share 2 cores
START_ATTEMPTS = 3
STOP_GRACE_S = 5.0  # sglang's own SIGTERM exit takes ~7 s; its processes hold nothing we need

CPU_FLAGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--disable-overlap-schedule",
    "--dtype", "bfloat16",
    "--skip-tokenizer-init",
    "--enable-metrics",
    "--sleep-on-idle",
)  # fmt: skip
PD_FLAGS = ("--disaggregation-transfer-backend", "mooncake_tcp")
DECODE_FLAGS = (
    "--disaggregation-mode",
    "decode",
    "--disaggregation-decode-retraction-backup",
    "none",
)


_HANDED_OUT: set[int] = set()  # ports free_port gave out in this process


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now and that this process never handed
    out before (the kernel may offer a just-closed probe's port again: two servers of one
    deployment got the same one, and one's bootstrap server answered the other's /health)."""
    while True:
        with socket.socket() as probe:
            probe.bind((LOCALHOST, 0))
            port = probe.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@dataclasses.dataclass
class Server:
    """One started server: its process group (led by its keeper), its URL and its log file."""

    name: str
    url: str
    process: subprocess.Popen
    log_path: Path
    bootstrap_port: int | None = None  # prefill servers: the disaggregation bootstrap port
    ready_path: str = "/health"
    stopped: bool = False  # its group was stopped or killed: never signalled again

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a server that dies), and reap the leader."""
        if self.stopped:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.stopped = True

    def stop(self) -> None:
        """SIGTERM the process group, wait for all of it, SIGKILL what is left after the grace.

        Once stopped (or killed), a server is not signalled again: a deployment may stop some
        of its servers early (to make room for others), and its end stops every server; the
        group's id, free once its processes are gone, may by then lead someone else's group.
        """
        stop_all([self])


def stop_all(servers: Iterable[Server]) -> None:
    """Stop `servers` together: SIGTERM every group at once, one grace for all, then SIGKILL.

    sglang takes longer than the grace to exit on SIGTERM, so each stop runs it out: one
    after another, a deployment of six took 30 s to stop, together 5 s. Servers stopped or
    killed before are skipped (`Server.stop`)."""
    running = [server for server in servers if not server.stopped]
    for server in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(
        _group_alive(server.process.pid, server.process) for server in running
    ):
        time.sleep(0.2)
    for server in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
        server.stopped = True


def _group_alive(group: int, leader: subprocess.Popen) -> bool:
    """True while any process of `group` exists (the leader reaped first, as our child)."""
    leader.poll()
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """What to start: sglang's arguments beyond the CPU flags, and extra environment."""

    name: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    command: tuple[str, ...] = (sys.executable, "-m", "sglang.launch_server")
    bootstrap: bool = False  # a prefill server: it gets a free disaggregation bootstrap port
    prometheus_port: bool = False  # the router: its metrics server gets a free port (default 29000)
    python_path: tuple[str, ...] = ()  # folders ahead of the CPU scaffolding on PYTHONPATH
    ready_path: str = "/health"  # answers 200 once the server takes requests


def sglang_spec(
    name: str,
    model: Path,
    page_size: int,
    role: str,
    *extra: str,
    env: dict[str, str] | None = None,
    python_path: tuple[str, ...] = (),
) -> ServerSpec:
    """A `plain`, `prefill` or `decode` sglang server of `model` with CPU flags and `extra`."""
    args = ("--model-path", str(model), "--page-size", str(page_size), *CPU_FLAGS)
    if role == "prefill":
        args += (*PD_FLAGS, "--disaggregation-mode", "prefill")
    elif role == "decode":
        args += (*PD_FLAGS, *DECODE_FLAGS)
    elif role != "plain":
        raise ValueError(f"unknown role {role!r}")
    env_items = tuple((env or {}).items())
    bootstrap = role == "prefill"
    return ServerSpec(name, args + extra, env_items, bootstrap=bootstrap, python_path=python_path)


def router_spec(prefills: Sequence[Server], decode: Server) -> ServerSpec:
    """The `smg` PD router in front of `prefills` and `decode`."""
    args = ["launch", "--pd-disaggregation", "--policy", "round_robin"]
    for prefill in prefills:
        args += ["--prefill", prefill.url, str(prefill.bootstrap_port)]
    args += ["--decode", decode.url, "--log-level", "info"]
    smg = Path(sys.executable).with_name("smg")
    # The router's /health answers before it has registered its workers; /readiness after.
    # Its metrics server would bind 0.0.0.0:29000: two suites at once on one machine collide.
    return ServerSpec(
        "router", tuple(args), command=(str(smg),), prometheus_port=True, ready_path="/readiness"
    )


def server_env(spec: ServerSpec, metrics_dir: Path) -> dict[str, str]:
    """A server's environment: this one, the CPU scaffolding on PYTHONPATH, sglang's CPU engine,
    and its own prometheus folder (sglang leaves the one it makes in /tmp behind when killed)."""
    env = dict(os.environ)
    env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    env.pop("TRITON_INTERPRET", None)  # the test process's interpreter switch, not a user's
    path = [*spec.python_path, str(CPU_SCAFFOLDING), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["SGLANG_HOST_IP"] = LOCALHOST
    env.update(spec.env)
    return env


def start(spec: ServerSpec, log_path: Path) -> Server:
    """Start `spec` on free ports in a new process group under its keeper, logging to `log_path`.

    The keeper (`watchdog.py`, the group's leader and `Server.process`) runs the
    server as its child and kills the group when this process dies.
    """
    port = free_port()
    bootstrap_port = free_port() if spec.bootstrap else None
    command = [*spec.command, *spec.args, "--host", LOCALHOST, "--port", str(port)]
    if bootstrap_port is not None:
        command += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    if spec.prometheus_port:
        command += ["--prometheus-host", LOCALHOST, "--prometheus-port", str(free_port())]
    metrics_dir = log_path.with_suffix(f".prometheus-{port}")
    metrics_dir.mkdir()
    with log_path.open("w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        process = subprocess.Popen(
            [sys.executable, "-I", str(WATCHDOG), str(os.getpid()), "--", *command],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_env(spec, metrics_dir),
            start_new_session=True,
        )
    url = f"http://{LOCALHOST}:{port}"
    return Server(spec.name, url, process, log_path, bootstrap_port, spec.ready_path)


def _ready(server: Server) -> bool:
    """True once `server` answers its ready path; raise with its log if it exited or if
    sglang could not run a plugin (it logs that and serves on without it)."""
    if server.process.poll() is not None:
        raise RuntimeError(
            f"{server.name} exited with {server.process.returncode} during start-up; "
            f"log {server.log_path}:\n{server.log_tail()}"
        )
    log = server.log_path.read_text(errors="replace")
    if "Failed to execute general plugin" in log:
        start = log.index("Failed to execute general plugin")
        raise RuntimeError(
            f"{server.name}: a plugin failed; log {server.log_path}:\n{log[start:][:3000]}"
        )
    with contextlib.suppress(requests.RequestException):
        return requests.get(server.url + server.ready_path, timeout=5).status_code == 200
    return False


def _port_taken(server: Server) -> bool:
    """The server lost a race for one of its ports (free when picked, taken before it bound)."""
    return "address already in use" in server.log_path.read_text(errors="replace").lower()


@contextlib.contextmanager
def servers_running(specs: Sequence[ServerSpec], log_dir: Path) -> Iterator[dict[str, Server]]:
    """Start `specs` together, wait until all are ready, yield them by name; always stop them.

    A server that lost one of its ports to another process is stopped and
    started again on new ports (its earlier log kept as `<name>.<attempt>.log`).
    The machine's deployment lock is held from before the first start until the
    last server has stopped (another process's deployment is waited for first).
    Within one process the lock nests: a deployment in phases stops some of its
    servers (`Server.stop`, not signalled again at the end) and starts the next
    ones together in a `servers_running` inside this one.
    """
    with machine_lock(f"{', '.join(spec.name for spec in specs)} in {log_dir}"):
        servers = {spec.name: start(spec, log_dir / f"{spec.name}.log") for spec in specs}
        try:
            specs_by_name = {spec.name: spec for spec in specs}
            attempts = dict.fromkeys(servers, 1)
            deadline = time.monotonic() + START_TIMEOUT_S
            waiting = set(servers)
            while waiting:
                for name in sorted(waiting):
                    server = servers[name]
                    if _port_taken(server) and attempts[name] < START_ATTEMPTS:
                        server.stop()
                        server.log_path.rename(log_dir / f"{name}.{attempts[name]}.log")
                        attempts[name] += 1
                        servers[name] = start(specs_by_name[name], log_dir / f"{name}.log")
                    elif _ready(server):
                        waiting.discard(name)
                if waiting and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{', '.join(sorted(waiting))} not ready after {START_TIMEOUT_S:.0f} s; "
                        f"logs in {log_dir}"
                    )
                time.sleep(1.0)
            yield servers
        finally:
            stop_all(servers.values())

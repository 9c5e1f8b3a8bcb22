"""Start the real appliance (real vLLM CPU engine) as a subprocess, for tests and benchmarks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
import uvicorn

from appliance.boot import config
from appliance.engine.args import ENGINE_BASE_URL
from tests import loopback

REPO = Path(__file__).resolve().parent.parent


def _which(tool: str) -> str | None:
    return shutil.which(tool) or (f"/usr/sbin/{tool}" if Path(f"/usr/sbin/{tool}").exists() else None)


def needs_tools(*tools: str) -> pytest.MarkDecorator:
    """Skip where a system tool is missing (a developer's box); under CI=true that skip is a failure naming
    the tool (tests/conftest.py), since `make test` installs every one (scripts/setup-test-tools.sh)."""
    missing = [t for t in tools if _which(t) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed (make test-tools installs it)")


def require_tool(tool: str) -> str:
    """The tool's path, or a skip (a failure under CI) naming it."""
    path = _which(tool)
    if path is None:
        pytest.skip(f"{tool} not installed (make test-tools installs it)")
    return path


@dataclass
class ThreadedServer:
    """An ASGI app served by uvicorn on 127.0.0.1 in a daemon thread (the tests' stand-in servers)."""
    server: uvicorn.Server
    thread: threading.Thread
    port: int

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve_in_thread(app, port: int = 0, **config) -> ThreadedServer:
    """`app` served on 127.0.0.1:`port`, listening when this returns; `config` goes to uvicorn.Config.

    The socket is bound here and handed to uvicorn, so with port 0 the kernel's pick is held from the start:
    no other server of the session can be given the same port before this one listens (see free_port)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    bound = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=bound, lifespan="off",
                                           **{"log_level": "warning", **config}))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, f"uvicorn did not start on port {bound}"
    return ThreadedServer(server, thread, bound)


async def asgi_body(receive) -> bytes:
    """A whole request body read from ASGI `receive` (the tests' and benches' stand-in servers)."""
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            return body


_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()


def free_port() -> int:
    """A port nothing listens on now, for a server another process will bind later (vLLM, the appliance).

    Never one this process handed out before: between this call and that server's bind (vLLM takes tens of
    seconds) the port is free again, and the kernel may pick it for the next caller. CI once gave a regional
    vLLM and the fault injector the same port, and vLLM died with EADDRINUSE. A server in this process
    should bind port 0 itself instead (serve_in_thread, asyncio.start_server), which leaves no window."""
    held: list[socket.socket] = []  # rejected picks stay bound until the end, so the kernel moves on
    try:
        with _HANDED_OUT_LOCK:
            for _ in range(1000):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
                if port not in _HANDED_OUT:
                    _HANDED_OUT.add(port)
                    return port
        raise RuntimeError("no port left that this test process has not handed out already")
    finally:
        for s in held:
            s.close()


def process_cpu_s(pid: int) -> float:
    """CPU seconds another process has spent (user + system, every thread it has had), to the nanosecond.

    psutil's cpu_times() reads /proc/PID/stat, which counts in clock ticks of 10 ms. The benches measure a
    front's CPU over batches of 100 to 300 ms, so one tick was several percent of a figure they compare
    with a goal. The kernel keeps a CPU clock per process that another process may read too (what
    clock_getcpuclockid(3) returns); Python has no clock_getcpuclockid, so the clock's id is built as
    glibc builds it: ((~pid) << 3) | CPUCLOCK_SCHED (2), process-wide. An ended process raises OSError."""
    return time.clock_gettime(((~pid) << 3) | 2)


def default_model_path() -> Path:
    from appliance.boot.default_model import default_model_dir, install_default, is_converted

    path = Path(os.environ.get("APPLIANCE_TEST_MODEL", default_model_dir()))
    if not is_converted(path) and not (path / "config.json").is_file():
        install_default(path)
    return path


def model_stand_in(parent: Path) -> Path:
    """The embedded default's config.json alone (weights estimated): enough to plan, nothing to serve."""
    folder = parent / "smollm2-135m-instruct"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text((REPO / "tests/fixtures/models/smollm2-135m-instruct.json").read_text())
    return folder


# A safetensors file with no tensors: its header (an 8-byte length, then "{}") is what start-up reads.
EMPTY_SAFETENSORS = b"\x02" + b"\0" * 7 + b"{}"


def model_folder(parent: Path) -> Path:
    """What startup.runtime_problems looks for, and no more: a folder with config.json and a weights file."""
    folder = parent / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(EMPTY_SAFETENSORS)
    return folder


def send_raw(port: int, path: str, body: dict, headers: dict[str, str] | None = None) -> socket.socket:
    """POST a JSON body over a raw socket and return it unread, so the test decides exactly when the
    client goes away (closing it): a client timeout would race the engine's speed."""
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(head + data)
    return sock


def shared_engine_cache() -> Path:
    """vLLM's compile cache, kept between runs so only the first run pays for compilation."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "appliance" / "test-engine-cache"


def short_private_dir() -> Path:
    """A directory for the engine's sockets whose path stays short: pytest's own folders are too long for a
    Unix socket path (appliance.engine.supervisor.MAX_SOCKET_DIR). Made 0700, as the daemon wants it."""
    return Path(tempfile.mkdtemp(prefix="ae-")) / "engine"


def write_config(directory: Path, *, port: int | None = None,
                 served_name: str = "smollm2-135m-instruct", enforce_eager: bool = True,
                 extra: str = "", engine_extra: str = "", server_extra: str = "", max_num_seqs: int = 16, max_model_len: int = 2048,
                 model: Path | None = None, kv_cache_memory_bytes: str | int = "1GiB", model_extra: str = "",
                 cache_dir: Path | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "appliance.toml"
    kv_toml = f'"{kv_cache_memory_bytes}"' if isinstance(kv_cache_memory_bytes, str) else str(kv_cache_memory_bytes)
    path.write_text(
        f"""
[model]
path = "{model or default_model_path()}"
served_name = "{served_name}"
{model_extra}

[server]
host = "127.0.0.1"
port = {port or free_port()}
retry_after_s = 3
{server_extra}

[state]
directory = "{directory / 'state'}"

[engine]
socket_dir = "{short_private_dir()}"
kv_cache_memory_bytes = {kv_toml}
max_model_len = {max_model_len}
max_num_seqs = {max_num_seqs}
enforce_eager = {str(enforce_eager).lower()}
cache_dir = "{cache_dir or shared_engine_cache()}"
stop_grace_s = 10
restart_backoff_initial_s = 1
{engine_extra}
{extra}
"""
    )
    return path


@dataclass
class RunningAppliance:
    config: Path
    proc: subprocess.Popen
    log_path: Path
    port: int
    served_name: str
    _log_file: object = field(repr=False, default=None)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine_socket(self) -> Path:
        return config.load(self.config).engine_socket

    @property
    def database(self) -> Path:
        return config.load(self.config).database_path

    def engine_get(self, path: str, **kwargs) -> httpx.Response:
        """GET from the engine itself, through its private Unix socket (as the appliance's user)."""
        with loopback.unix_client(str(self.engine_socket), base_url=ENGINE_BASE_URL) as c:
            return c.get(path, **kwargs)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"appliance exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                if loopback.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"appliance not ready after {timeout}s:\n{self.log_text()[-4000:]}")

    def guard(self) -> psutil.Process:
        return next(p for p in self.descendants() if "appliance.engine.guard" in " ".join(p.cmdline()))

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def engine_processes(self) -> list[psutil.Process]:
        """The vLLM API server and its EngineCore (the guard excluded)."""
        out = []
        for p in self.descendants():
            try:
                cmd = " ".join(p.cmdline())
                if "appliance.engine.guard" in cmd:
                    continue
                if "vllm" in cmd or "EngineCore" in p.name() or "EngineCore" in cmd:
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log_file:
            self._log_file.close()
        if self in RUNNING:
            RUNNING.remove(self)
        return self.proc.returncode


# Every appliance a test started and has not stopped: a failed test's report carries their log tails
# (tests/conftest.py), since CI shows only pytest's output and the logs die with the temporary folder.
RUNNING: list[RunningAppliance] = []


def start_appliance(directory: Path, env: dict[str, str] | None = None, **config_kwargs) -> RunningAppliance:
    return launch_appliance(write_config(directory, **config_kwargs), directory, env)


def launch_appliance(cfg_path: Path, directory: Path, env: dict[str, str] | None = None) -> RunningAppliance:
    """`appliance serve` on a configuration file that names its ports; its log goes to directory."""
    import tomllib

    raw = tomllib.loads(cfg_path.read_text())
    log_path = directory / "appliance.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 (the child writes to it until stop() closes it)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "appliance.cli", "serve", "--config", str(cfg_path)],
        stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO, env=env,
    )
    running = RunningAppliance(
        config=cfg_path, proc=proc, log_path=log_path, port=raw["server"]["port"],
        served_name=raw["model"]["served_name"], _log_file=log_file,
    )
    RUNNING.append(running)
    return running


class NotifyListener:
    """A NOTIFY_SOCKET of our own: what systemd would receive from the daemon."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.messages: list[str] = []
        self.times: list[float] = []  # time.monotonic() at each message
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                message = self._sock.recv(4096).decode()
                self.times.append(time.monotonic())
                self.messages.append(message)
            except OSError:
                continue

    def index(self, prefix: str, start: int = 0) -> int:
        return next(i for i, m in enumerate(self.messages) if i >= start and m.startswith(prefix))

    def has(self, prefix: str, start: int = 0) -> bool:
        return any(m.startswith(prefix) for m in self.messages[start:])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition", explain=None):
    """Poll until `predicate` is true; on timeout fail, with `explain()` (what was going on) when given."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    detail = f"\n{explain()}" if explain is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{detail}")


def sockets(app: RunningAppliance) -> str:
    """Its API and engine ports' TCP connections with their queues: bytes waiting to be read (Recv-Q) or
    not yet taken by the peer (Send-Q) tell a reader that stopped from a writer that did."""
    ports = f"sport = :{app.port} or dport = :{app.port}"
    try:
        out = subprocess.run(["ss", "-tnpiH", "state", "all", "exclude", "time-wait", f"( {ports} )"],
                             capture_output=True, text=True, timeout=10)
        engine = subprocess.run(["ss", "-xpH", "src", str(app.engine_socket)], capture_output=True, text=True,
                                timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return f"(ss: {e})"
    def tidy(run: subprocess.CompletedProcess) -> str:
        # ss pads its columns to the terminal's width: one space apart is enough to read
        return "\n".join(" ".join(line.split()) for line in (run.stdout or run.stderr).splitlines() if line.strip())

    return (f"state recv-q send-q local peer process (then its TCP info)\n{tidy(out)}\n"
            f"the engine's Unix socket (netid state recv-q send-q local peer process):\n{tidy(engine)}")


def other_threads() -> str:
    """Where this process's other threads (stream readers, pools) are: connecting, waiting for headers, reading."""
    from appliance.ops.state_dump import thread_stacks

    return "\n".join(thread_stacks(skip=threading.get_ident())) or "(none)"


def state_dump(app: RunningAppliance, timeout: float = 10) -> str | None:
    """SIGUSR1 to the daemon, and the dump it logs (appliance.ops.state_dump), from its header to its end line;
    None when none comes within `timeout` (the daemon's event loop did not run the handler)."""
    from appliance.ops.state_dump import END, HEADER

    start = len(app.log_text())
    os.kill(app.proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = app.log_text()[start:]
        if END in new:
            return new[new.index(HEADER):new.index(END) + len(END)]
        time.sleep(0.2)
    return None


def in_flight(app: RunningAppliance) -> str:
    """The gateway's own view of its requests now (GET /v1/appliance/requests), for a failure message."""
    try:
        return json.dumps(loopback.get(f"{app.url}/v1/appliance/requests", timeout=10).json(), indent=1)
    except (httpx.HTTPError, ValueError) as e:
        return f"(GET /v1/appliance/requests: {type(e).__name__}: {e})"


def snapshot(app: RunningAppliance) -> str:
    """What a test that waited in vain saw at that moment, before its clean-up changes it."""
    return (f"--- the gateway's requests in flight ---\n{in_flight(app)}\n"
            f"--- sockets ---\n{sockets(app)}\n--- this process's other threads ---\n{other_threads()}")

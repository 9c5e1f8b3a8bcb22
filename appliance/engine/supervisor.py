"""Runs exactly one vLLM child, knows its state, restarts it with back-off, and never leaves it behind.

Lifecycle of one attempt: spawn (through the guard, see guard.py) -> stream its
log -> poll /health until 200 -> READY -> wait for exit. On exit the reason is
taken from the exit status and the last log lines; the supervisor restarts
with exponential back-off until `max_failures` deaths fall inside
`failure_window_s`, then reports FAILED and stops trying (the daemon exits
non-zero so systemd and the operator see it).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import re
import secrets
import signal
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from appliance.boot.config import Config
from appliance.engine.args import ENGINE_BASE_URL, EngineLaunch, build_launch, describe
from appliance.engine.guard import EXIT_LINE_PREFIX
from kernels.backend import BackendTracker

log = logging.getLogger("appliance.engine")
engine_log = logging.getLogger("appliance.engine.vllm")

_ERROR_LINE = re.compile(r"(Error|Exception)\b|\bERROR\b|error:")
_PGID_RE = re.compile(re.escape(EXIT_LINE_PREFIX) + r" engine pgid (\d+)")
_STATUS_HINTS = [
    # (pattern in the last log lines, what an operator should do)
    (re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory", re.I),
     "the engine ran out of memory: lower engine.kv_cache_memory_bytes or engine.max_num_seqs"),
    (re.compile(r"No module named '?vllm'?"), "vLLM is not installed for engine.python; run `make setup`"),
    (re.compile(r"(does not appear to have|Can't load|not a valid model|Invalid repository ID)", re.I),
     "the model folder could not be loaded; check model.path"),
    (re.compile(r"Address already in use"), "the engine's socket is taken by another engine; is a second "
                                            "appliance using the same state directory?"),
    (re.compile(r"max_model_len.*(greater|larger|exceeds)", re.I),
     "engine.max_model_len is larger than the model or the KV pool allows"),
]


class EngineState(enum.StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPING = "stopping"


@dataclass
class EngineStatus:
    state: EngineState = EngineState.STOPPED
    reason: str = "not started"
    since: float = field(default_factory=time.time)
    restarts: int = 0
    pid: int | None = None
    last_exit: str | None = None
    attention_backend: str | None = None  # as the engine reported it at start (kernels/backend.py)

    def as_dict(self) -> dict[str, object]:
        return {
            "attention_backend": self.attention_backend,
            "state": self.state.value,
            "reason": self.reason,
            "since": self.since,
            "restarts": self.restarts,
            "pid": self.pid,
            "last_exit": self.last_exit,
        }


StateListener = Callable[[EngineStatus], Awaitable[None] | None]


# sun_path holds 108 bytes with the terminating NUL (Linux). vLLM names its ZeroMQ sockets in the same
# directory with a 36-character UUID, so the directory itself may take 107 - 37 bytes.
MAX_SOCKET_PATH = 107
MAX_SOCKET_DIR = MAX_SOCKET_PATH - 37


def prepare_socket_dir(socket_path: Path) -> Path:
    """The engine's socket directory, private to this user (0700), with no stale socket left in it.

    The directory's mode is what keeps everyone else out: a Unix socket's own mode is not checked by every
    system, the directory's search permission is. An existing directory another user owns is refused
    rather than trusted."""
    d = socket_path.parent
    if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH or len(os.fsencode(d)) > MAX_SOCKET_DIR:
        raise OSError(f"{d} is {len(os.fsencode(d))} bytes long: the engine's sockets in it would pass the "
                      f"{MAX_SOCKET_PATH} bytes a Unix socket path may have (at most {MAX_SOCKET_DIR} for the "
                      "directory); set engine.socket_dir to a shorter one, such as /run/appliance")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.geteuid():
        raise OSError(f"{d} belongs to uid {st.st_uid}, not to this service's user ({os.geteuid()}); "
                      "remove it or set engine.socket_dir")
    if st.st_mode & 0o077:
        d.chmod(0o700)
    socket_path.unlink(missing_ok=True)  # left by an engine that was killed: vLLM would fail to bind
    return socket_path


def explain_exit(returncode: int, last_lines: list[str]) -> str:
    """One sentence for the operator: how the engine ended and, when we can tell, what to do."""
    guard_line = next(
        (line for line in reversed(last_lines) if line.startswith(EXIT_LINE_PREFIX) and not _PGID_RE.match(line)), None
    )
    if guard_line:
        how = guard_line[len(EXIT_LINE_PREFIX):].strip()
    elif returncode < 0:
        how = f"engine guard killed by signal {signal.Signals(-returncode).name}"
    else:
        how = f"engine exited with status {returncode}"
    tail = "\n".join(last_lines)
    for pattern, hint in _STATUS_HINTS:
        if pattern.search(tail):
            return f"{how}: {hint}"
    errors = [line for line in last_lines if _ERROR_LINE.search(line) and not line.startswith(EXIT_LINE_PREFIX)]
    if errors:
        return f"{how}; last error: {errors[-1].strip()[:300]}"
    return how


# How far back before an exit the engine's log may hold its cause. Older lines are not it: an error a
# request provoked twenty minutes earlier would otherwise be quoted as the reason the engine died.
EXIT_CONTEXT_S = 60.0


class LogTail:
    """The engine's last log lines, each with the time it came, so an exit is explained from its own."""

    def __init__(self, maxlen: int = 60, clock: Callable[[], float] = time.monotonic) -> None:
        self._lines: deque[tuple[float, str]] = deque(maxlen=maxlen)
        self._clock = clock

    def append(self, line: str) -> None:
        self._lines.append((self._clock(), line))

    def clear(self) -> None:
        self._lines.clear()

    def recent(self, window_s: float) -> list[str]:
        since = self._clock() - window_s
        return [line for t, line in self._lines if t >= since]


async def _exit_status(proc: asyncio.subprocess.Process) -> int:
    """The guard's exit status, as soon as it has exited.

    Not proc.wait(): asyncio resolves that only once every pipe has closed too, and
    an engine process orphaned by a killed guard keeps the log pipe open.
    """
    while proc.returncode is None:
        await asyncio.sleep(0.1)
    return proc.returncode


class EngineSupervisor:
    def __init__(self, cfg: Config, engine_args: Sequence[str], *, guard_python: str | None = None) -> None:
        self.cfg = cfg
        self.engine_args = list(engine_args)
        self.internal_key = secrets.token_urlsafe(32)
        self.status = EngineStatus()
        self.launch: EngineLaunch | None = None
        self.gave_up = asyncio.Event()
        self.last_lines = LogTail()
        self._backend = BackendTracker()
        self._guard_python = guard_python or sys.executable
        self._listeners: list[StateListener] = []
        self._proc: asyncio.subprocess.Process | None = None
        self._engine_pgid: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._changed = asyncio.Event()  # set, and replaced, at every state change (until_ready waits on it)
        self._failures: deque[float] = deque()
        self._relaunch_reason: str | None = None

    # -- public surface -------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.status.state is EngineState.READY

    @property
    def base_url(self) -> str | None:
        return self.launch.base_url if self.launch else None

    @property
    def coming_back(self) -> bool:
        """The engine served and is expected to serve again: it died and is being restarted, or it is being
        relaunched on purpose. Not a first start (its length is the model's load) nor a supervisor that
        gave up."""
        return self.status.state is EngineState.RESTARTING

    async def until_ready(self, timeout: float) -> bool:
        """Wait while the engine is coming back, at most `timeout` s: True once it serves, False when the
        time is up or the supervisor gave up or stops."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.coming_back:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return self.ready

    def add_listener(self, fn: StateListener) -> None:
        self._listeners.append(fn)

    @property
    def key_file(self) -> Path:
        """The internal key, readable only by the appliance's user, for debugging the engine directly."""
        return self.cfg.state.directory / "engine.key"

    async def start(self) -> None:
        self.cfg.state.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.internal_key + "\n")
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="engine-supervisor")

    async def relaunch(self, engine_args: Sequence[str], reason: str,
                       drain: Callable[[], Awaitable[None]] | None = None) -> None:
        """Stop the engine and start it again with new arguments: a decision, not a failure.

        It neither counts towards giving up nor waits out a back-off; requests meanwhile get 503
        with Retry-After, as during any restart. `drain`, awaited between refusing new work and
        stopping the engine, lets the requests the engine is answering finish.
        """
        self.engine_args = list(engine_args)
        self._relaunch_reason = reason
        log.warning("relaunching the engine: %s", reason)
        # Not ready from now on: new requests get 503 rather than an engine that is shutting down.
        await self._set(EngineState.RESTARTING, f"relaunching: {reason}")
        proc = self._proc
        if drain is not None:
            await drain()
        if self._proc is not proc:
            return  # the engine died while draining and the loop already started it with the new arguments
        await self._terminate()

    async def stop(self) -> None:
        self._stopping.set()
        await self._set(EngineState.STOPPING, "appliance is stopping")
        await self._terminate()
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._set(EngineState.STOPPED, "stopped")

    # -- the loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = self.cfg.engine.restart_backoff_initial_s
        first = True
        while not self._stopping.is_set():
            started = time.monotonic()
            reason = await self._one_attempt(first)
            first = False
            if self._stopping.is_set():
                return
            if self._relaunch_reason is not None:
                continue  # relaunch() already said so; the next attempt clears the reason
            self.status.last_exit = reason
            now = time.monotonic()
            self._failures.append(now)
            while self._failures and now - self._failures[0] > self.cfg.engine.failure_window_s:
                self._failures.popleft()
            if len(self._failures) >= self.cfg.engine.max_failures:
                await self._set(
                    EngineState.FAILED,
                    f"engine failed {len(self._failures)} times within {self.cfg.engine.failure_window_s:g}s; "
                    f"giving up. Last: {reason}",
                )
                log.error("%s", self.status.reason)
                self.gave_up.set()
                return
            # A long healthy run resets the back-off: this death is news, not a crash loop.
            if now - started > self.cfg.engine.restart_backoff_max_s * 2:
                backoff = self.cfg.engine.restart_backoff_initial_s
            self.status.restarts += 1
            await self._set(EngineState.RESTARTING, f"{reason}; restarting in {backoff:g}s")
            log.warning("engine died (%s); restart %d in %.1fs", reason, self.status.restarts, backoff)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=backoff)
            backoff = min(backoff * 2, self.cfg.engine.restart_backoff_max_s)

    async def _one_attempt(self, first: bool) -> str:
        self._relaunch_reason = None  # asked for between attempts: this attempt already uses the new arguments
        try:
            socket_path = prepare_socket_dir(self.cfg.engine_socket)
        except OSError as e:
            return f"cannot prepare the engine's socket directory: {e}"
        self.launch = build_launch(self.cfg, self.engine_args, self.internal_key)
        self.last_lines.clear()
        self._engine_pgid = None
        self._backend = BackendTracker()
        if first:
            await self._set(EngineState.STARTING, "loading model")
        else:
            self.status.reason = f"{self.status.reason.split(';')[0]}; loading model again"
        log.info("starting engine on unix:%s: %s", socket_path, describe(self.launch))
        try:
            self._proc = await self._spawn_guard(self.launch)
        except OSError as e:
            return f"cannot start the engine guard: {e}"
        self.status.pid = self._proc.pid
        pump = asyncio.create_task(self._pump_logs(self._proc))
        exited = asyncio.create_task(_exit_status(self._proc))
        healthy = asyncio.create_task(self._wait_healthy(socket_path))
        done, _ = await asyncio.wait(
            {exited, healthy}, timeout=self.cfg.engine.startup_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if healthy in done and healthy.result():
            await self._set(EngineState.READY, "serving")
            log.info("engine ready on unix:%s", socket_path)
            await exited
        elif not done:
            healthy.cancel()
            log.error("engine not healthy after %.0fs; stopping it", self.cfg.engine.startup_timeout_s)
            await self._terminate()
            await exited
            await self._drain(pump)
            return f"engine did not become healthy within {self.cfg.engine.startup_timeout_s:g}s"
        else:
            healthy.cancel()
        # If the guard itself was killed, engine processes may still run and hold the log pipe:
        # kill them first, then read what is left of their log.
        self._kill_leftovers(self._engine_pgid)
        await self._drain(pump)
        rc = exited.result()
        self.status.pid = None
        return explain_exit(rc, self.last_lines.recent(EXIT_CONTEXT_S))

    async def _spawn_guard(self, launch: EngineLaunch) -> asyncio.subprocess.Process:
        """The guard (appliance.engine.guard) in a session of its own, running the launch's argv: it kills
        the engine's whole process group when this daemon dies."""
        argv = [
            self._guard_python, "-m", "appliance.engine.guard",
            "--parent-pid", str(os.getpid()),
            "--grace", str(self.cfg.engine.stop_grace_s),
            "--", *launch.argv,
        ]
        self.cfg.engine_cache_dir.mkdir(parents=True, exist_ok=True)
        return await asyncio.create_subprocess_exec(
            *argv,
            env=launch.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            limit=1 << 20,
        )

    async def _drain(self, pump: asyncio.Task[None]) -> None:
        try:
            await asyncio.wait_for(pump, timeout=5)
        except TimeoutError:
            log.warning("engine log pipe still open 5s after the engine exited; not waiting for it")

    async def _wait_healthy(self, socket_path: Path) -> bool:
        # verify=False, on the transport (a client's own verify does not reach a transport handed to it): no
        # TLS on a Unix socket, and it spares this event loop httpx's parse of the whole CA bundle (OpenSSL 3:
        # tens of ms of CPU, once seen to stall a starved process for a minute) on every engine start.
        transport = httpx.AsyncHTTPTransport(uds=str(socket_path), verify=False)
        async with httpx.AsyncClient(base_url=ENGINE_BASE_URL, transport=transport, timeout=2.0) as client:
            while True:
                try:
                    r = await client.get("/health")
                    if r.status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)

    async def _pump_logs(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while True:
            try:
                raw = await proc.stdout.readline()
            except ValueError:  # a line longer than the limit: skip it, keep reading
                continue
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip()
            if not line:
                continue
            self.last_lines.append(line)
            self._backend.feed(line)
            self.status.attention_backend = self._backend.backend
            m = _PGID_RE.search(line)
            if m:
                self._engine_pgid = int(m.group(1))
            engine_log.info("%s", line)

    async def _terminate(self) -> None:
        """SIGTERM the guard (it forwards to the engine's group, then SIGKILLs after the grace period)."""
        # This engine's group, taken now: once the guard exits, the loop may start the next engine (a
        # relaunch) before this resumes, and the clean-up must not reach that one.
        proc, pgid = self._proc, self._engine_pgid
        if proc is None or proc.returncode is not None:
            self._kill_leftovers(pgid)
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(_exit_status(proc), timeout=self.cfg.engine.stop_grace_s + 5)
        except TimeoutError:
            log.error("engine guard did not stop; killing the engine's process group")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await _exit_status(proc)
        self._kill_leftovers(pgid)

    @staticmethod
    def _kill_leftovers(pgid: int | None) -> None:
        # Belt and braces: the guard already did this unless it was itself killed.
        if pgid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)

    async def _set(self, state: EngineState, reason: str) -> None:
        if state is not self.status.state:
            self.status.since = time.time()
        self.status.state = state
        self.status.reason = reason
        self._changed.set()
        self._changed = asyncio.Event()
        for fn in self._listeners:
            try:
                res = fn(self.status)
                if asyncio.iscoroutine(res):
                    await res
            except Exception:
                log.exception("engine state listener failed")

"""Runs one vLLM child, knows its state, restarts it with back-off, and never leaves it behind.

Lifecycle of one attempt: spawn (through the guard, see guard.py) -> stream its
log -> poll /health until 200 -> READY -> wait for exit. On exit the reason is
taken from the exit status and the last log lines; the supervisor restarts
with exponential back-off until `max_failures` deaths fall inside
`failure_window_s`, then reports FAILED and stops trying (the daemon exits
non-zero so systemd and the operator see it).

Each engine binds a socket of its own and the configured path links to the serving one, so during an
upgrade's beside swap a second engine can start, pass its gate and take new requests while the first
finishes what it was answering (`try_beside`, `retire_previous`); otherwise one engine runs at a time.
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
# Checks a new engine, healthy on its socket, before it takes traffic: None when it passes, else why not.
Gate = Callable[[Path], Awaitable[str | None]]


@dataclass
class Trial:
    """A launch on trial (an upgrade): what to go back to, and how it went.

    While a trial runs, the supervisor does not restart the new engine when it fails to start, fails its
    gate or dies: it goes back to the fallback at once, without back-off and without counting a failure,
    and says why in `failed`. `serving` resolves once the new engine passed its gate and took traffic.
    The trial ends with `EngineSupervisor.end_trial()` (commit) or `abandon_trial()` (roll back)."""

    fallback_cfg: Config
    fallback_args: list[str]
    fallback_version: str
    gate: Gate | None
    serving: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    failed: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def fail(self, reason: str) -> None:
        if not self.failed.done():
            self.failed.set_result(reason)


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


LOWEST_PRIORITY = 19  # nice(1)'s lowest scheduling priority

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

    def recent(self, window_s: float) -> list[str]:
        since = self._clock() - window_s
        return [line for t, line in self._lines if t >= since]


def _lower_priority(pgid: int) -> None:
    """The engine's whole process group to the lowest priority, threads included (PRIO_PGRP). Where the
    kernel groups each session's processes for the scheduler (autogroup: the engine runs in a session of
    its own) a thread's nice counts only inside its group, so the group's own nice is lowered too
    (/proc/PID/autogroup, for the group leader's session). Under systemd's CPU controller there is no
    autogroup, and the per-thread nice does it."""
    done = []
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PGRP, pgid, LOWEST_PRIORITY)
        done.append("nice")
    with contextlib.suppress(OSError):
        Path(f"/proc/{pgid}/autogroup").write_text(f"{LOWEST_PRIORITY}\n")
        done.append("autogroup")
    log.info("the running engine yields the CPU to the new one while it loads (%s %d)", " and ".join(done) or
             "nothing could be lowered;", LOWEST_PRIORITY)


async def _exit_status(proc: asyncio.subprocess.Process) -> int:
    """The guard's exit status, as soon as it has exited.

    Not proc.wait(): asyncio resolves that only once every pipe has closed too, and
    an engine process orphaned by a killed guard keeps the log pipe open.
    """
    while proc.returncode is None:
        await asyncio.sleep(0.1)
    return proc.returncode


@dataclass
class _Run:
    """One engine (its guard and what the guard started) and what is known of it."""

    launch: EngineLaunch
    proc: asyncio.subprocess.Process
    tail: LogTail = field(default_factory=LogTail)
    backend: BackendTracker = field(default_factory=BackendTracker)
    pgid: int | None = None  # the engine's process group, as the guard reported it
    pump: asyncio.Task[None] | None = None
    exited: asyncio.Task[int] | None = None


class EngineSupervisor:
    def __init__(self, cfg: Config, engine_args: Sequence[str], *, guard_python: str | None = None,
                 version: str = "") -> None:
        self.cfg = cfg  # what the engine runs: the model and engine.python may change in an upgrade (Trial)
        self.engine_args = list(engine_args)
        self.version = version  # the model's digest the running engine loaded (X-Appliance-Model-Digest)
        self.internal_key = secrets.token_urlsafe(32)
        self.status = EngineStatus()
        self.launch: EngineLaunch | None = None
        self.gave_up = asyncio.Event()
        self._guard_python = guard_python or sys.executable
        self._listeners: list[StateListener] = []
        self._current: _Run | None = None  # the engine the loop watches
        self._candidate: _Run | None = None  # a new engine starting beside it (an upgrade's beside swap)
        self._adopt: _Run | None = None  # that engine once it took traffic, for the loop to watch next
        self._serving: tuple[Path, str] | None = None  # the serving engine's own socket and version
        self._generation = 0
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._changed = asyncio.Event()  # set, and replaced, at every state change (until_ready waits on it)
        self._failures: deque[float] = deque()
        self._relaunch_reason: str | None = None
        self._trial: Trial | None = None
        self._next_version = version
        self._background: set[asyncio.Task[None]] = set()

    # -- public surface -------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.status.state is EngineState.READY

    @property
    def base_url(self) -> str | None:
        return self.launch.base_url if self.launch else None

    @property
    def last_lines(self) -> LogTail:
        return self._current.tail if self._current is not None else LogTail()

    def endpoint(self) -> tuple[Path, str] | None:
        """The serving engine's own socket and the model digest it loaded, read together: a request sent
        there is answered by that engine even if an upgrade switches engines meanwhile (the old one serves
        until it has answered what was sent to it). None before an engine served."""
        return self._serving

    @property
    def coming_back(self) -> bool:
        """The engine served and is expected to serve again: it died and is being restarted, or it is being
        relaunched on purpose. Not a first start (its length is the model's load) nor a supervisor that
        gave up."""
        return self.status.state is EngineState.RESTARTING

    async def until_ready(self, timeout: float) -> bool:
        """Wait while the engine is coming back, at most `timeout` s: True once it serves, False when the
        time is up or the supervisor gave up or stops."""
        return await self._wait_while(lambda: self.coming_back, timeout) and self.ready

    async def noticed_down(self, timeout: float) -> bool:
        """Wait, at most `timeout` s, until the supervisor knows the engine is not serving (its socket may
        refuse before the supervisor has seen the exit): True once it does."""
        return await self._wait_while(lambda: self.ready, timeout)

    async def _wait_while(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Wait at state changes while `condition` holds, at most `timeout` s: False when the time ran out."""
        deadline = asyncio.get_running_loop().time() + timeout
        while condition():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return True

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
                       drain: Callable[[], Awaitable[None]] | None = None, *,
                       cfg: Config | None = None, version: str | None = None) -> None:
        """Stop the engine and start it again with new arguments (and, for an upgrade or a rollback, another
        model or engine: `cfg`): a decision, not a failure.

        It neither counts towards giving up nor waits out a back-off; new requests meanwhile are held or get
        503 with Retry-After, as during any restart. `drain`, awaited between refusing new work and
        stopping the engine, lets the requests the engine is answering finish.
        """
        self.engine_args = list(engine_args)
        if cfg is not None:
            self.cfg = cfg
        if version is not None:
            self._next_version = version
        self._relaunch_reason = reason
        log.warning("relaunching the engine: %s", reason)
        # Not ready from now on: new requests get 503 rather than an engine that is shutting down.
        await self._set(EngineState.RESTARTING, f"relaunching: {reason}")
        run = self._current
        if drain is not None:
            await drain()
        if self._current is not run:
            return  # the engine died while draining and the loop already started it with the new arguments
        await self._terminate(run)

    async def try_launch(self, cfg: Config, engine_args: Sequence[str], version: str, reason: str,
                         drain: Callable[[], Awaitable[None]] | None, gate: Gate | None) -> Trial:
        """Relaunch on `cfg` and `engine_args` as a trial, in place of the running engine (drained first):
        `gate` must pass before the new engine takes traffic, and any failure of it brings back what runs
        now (see Trial)."""
        trial = self._new_trial(gate)
        await self.relaunch(engine_args, reason, drain, cfg=cfg, version=version)
        return trial

    async def try_beside(self, cfg: Config, engine_args: Sequence[str], version: str, reason: str,
                         gate: Gate | None, *, yield_cpu: bool = False) -> Trial:
        """Start the new engine beside the running one, which serves on meanwhile; once it passes `gate`,
        new requests go to it at once (`trial.serving`). The old engine then answers only what was sent to
        it: `retire_previous` stops it. A new engine that fails to start or fails the gate is stopped and
        the old one never stopped serving.

        `yield_cpu` (CPU engines): the running engine is put to the lowest priority first. A busy CPU
        engine's worker spins on the core vLLM binds it to, which is the core a second engine's worker is
        bound to as well: beside it, the new worker ran 6 ms in 90 s (2 cores). A process may lower its own
        priority but not raise it again, so the old engine stays there until it retires or restarts."""
        trial = self._new_trial(gate)
        log.warning("starting a new engine beside the running one: %s", reason)
        if yield_cpu and self._current is not None and self._current.pgid:
            _lower_priority(self._current.pgid)
        task = asyncio.create_task(self._beside(trial, cfg, list(engine_args), version), name="engine-beside")
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return trial

    async def retire_previous(self, drain: Callable[[], Awaitable[None]] | None = None) -> None:
        """After a beside swap: the old engine finishes what was sent to it (`drain`), then stops, and the
        loop watches the new one from then on."""
        old = self._current
        if self._adopt is None or old is None:
            return
        if drain is not None:
            await drain()
        self._relaunch_reason = "the previous engine retired after an upgrade"
        await self._terminate(old)

    def _new_trial(self, gate: Gate | None) -> Trial:
        if self._trial is not None:
            raise RuntimeError("a trial is already running")
        self._trial = Trial(self.cfg, list(self.engine_args), self.version, gate)
        return self._trial

    @property
    def on_trial(self) -> bool:
        return self._trial is not None

    def end_trial(self) -> None:
        """The new engine stays: its failures from now on are restarts like any other."""
        self._trial = None

    async def abandon_trial(self, reason: str, drain: Callable[[], Awaitable[None]] | None = None) -> None:
        """Go back to the trial's fallback now (a probation that went wrong, while the new engine serves)."""
        trial, self._trial = self._trial, None
        if trial is None:
            return
        trial.fail(reason)
        await self.relaunch(trial.fallback_args, f"rolling back: {reason}", drain, cfg=trial.fallback_cfg,
                            version=trial.fallback_version)

    async def stop(self) -> None:
        self._stopping.set()
        await self._set(EngineState.STOPPING, "appliance is stopping")
        for run in (self._candidate, self._adopt, self._current):
            if run is not None:
                await self._terminate(run)
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
            if self._relaunch_reason is not None or self._adopt is not None:
                # relaunch() already said so, or an engine started beside took over (the next attempt
                # watches it); the next attempt clears the reason
                continue
            self.status.last_exit = reason
            if self._trial is not None:
                await self._fall_back(self._trial, reason)
                continue
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

    async def _fall_back(self, trial: Trial, reason: str) -> None:
        """A trial's engine failed (start, gate or death): the fallback's settings for the next attempt, now."""
        self._trial = None
        self.cfg, self.engine_args, self._next_version = trial.fallback_cfg, trial.fallback_args, \
            trial.fallback_version
        trial.fail(reason)
        log.error("the new engine failed (%s); going back to the previous one", reason)
        await self._set(EngineState.RESTARTING, f"rolling back: {reason}")

    async def _gate(self, socket_path: Path) -> str | None:
        """The trial's gate, run before the new engine takes traffic: None when it may."""
        trial = self._trial
        if trial is None or trial.gate is None or trial.serving.done():
            return None
        try:
            problem = await trial.gate(socket_path)
        except Exception as e:  # a gate that breaks is a gate that did not pass
            log.exception("the new engine's gate failed")
            problem = f"the gate itself failed: {e}"
        return None if problem is None else f"the new engine failed its gate: {problem}"

    async def _one_attempt(self, first: bool) -> str:
        self._relaunch_reason = None  # asked for between attempts: this attempt already uses the new arguments
        run, self._adopt = self._adopt, None
        if run is not None:  # started beside the previous engine, serving already
            self._current = run
            self.status.pid = run.proc.pid
            self.status.attention_backend = run.backend.backend
            await self._set(EngineState.READY, "serving")
        else:
            started = await self._start_here(first)
            if isinstance(started, str):
                return started
            run = started
        assert run.exited is not None
        await run.exited
        # If the guard itself was killed, engine processes may still run and hold the log pipe:
        # kill them first, then read what is left of their log.
        self._kill_leftovers(run.pgid)
        await self._drain(run)
        self.status.pid = None
        return explain_exit(run.exited.result(), run.tail.recent(EXIT_CONTEXT_S))

    async def _start_here(self, first: bool) -> _Run | str:
        """An engine in place of the last one: started, healthy and past a trial's gate (then serving), or
        why not (it is stopped by then)."""
        self.version = self._next_version
        socket_path = self._next_socket()
        if first:
            await self._set(EngineState.STARTING, "loading model")
        else:
            self.status.reason = f"{self.status.reason.split(';')[0]}; loading model again"
        try:
            prepare_socket_dir(socket_path)
            run = await self._spawn(self.cfg, self.engine_args, socket_path)
        except OSError as e:
            return f"cannot start the engine: {e}"
        self._current = run
        self.launch = run.launch
        self.status.pid = run.proc.pid
        problem = await self._until_healthy(run, socket_path)
        on_trial = self._trial is not None and not self._trial.serving.done()
        if problem is not None and on_trial:
            problem = f"the new engine failed to start: {problem}"
        if problem is None and on_trial:
            await self._set(EngineState.RESTARTING, "new engine up; checking it before it takes traffic")
            problem = await self._gate(socket_path)
        if problem is not None:
            await self._terminate(run)
            await self._drain(run)
            self.status.pid = None
            return problem
        self._serve_from(socket_path, self.version)
        await self._set(EngineState.READY, "serving")
        if self._trial is not None and not self._trial.serving.done():
            self._trial.serving.set_result(None)
        return run

    async def _beside(self, trial: Trial, cfg: Config, args: list[str], version: str) -> None:
        socket_path = self._next_socket()
        try:
            prepare_socket_dir(socket_path)
            run = await self._spawn(cfg, args, socket_path)
        except OSError as e:
            self._end_beside(trial, f"cannot start the new engine: {e}")
            return
        self._candidate = run
        problem = await self._until_healthy(run, socket_path) or await self._gate(socket_path)
        self._candidate = None
        if problem is None and (trial.failed.done() or self._stopping.is_set()):
            problem = "abandoned while it started"
        if problem is not None:
            await self._terminate(run)
            await self._drain(run)
            self._end_beside(trial, problem if "gate" in problem else f"the new engine failed to start: {problem}")
            return
        # The switch: new requests go to the new engine from this instant; the old one answers what it has.
        self.cfg, self.engine_args, self.version, self._next_version = cfg, args, version, version
        self.launch = run.launch
        self._adopt = run
        self._serve_from(socket_path, version)
        log.warning("the new engine serves; the previous one finishes what it was answering")
        trial.serving.set_result(None)

    def _end_beside(self, trial: Trial, reason: str) -> None:
        self._trial = None
        log.error("the new engine started beside the running one failed (%s); the running one serves on", reason)
        trial.fail(reason)

    # -- one engine ---------------------------------------------------------------------------

    def _next_socket(self) -> Path:
        """Each engine binds a socket of its own (two may run during an upgrade); the configured path is a
        link to the serving one (`_serve_from`), for the clients that need not know which."""
        self._generation += 1
        if self._generation == 1:  # what engines of a killed daemon left
            for stale in self.cfg.engine_socket.parent.glob("engine-*.sock"):
                stale.unlink(missing_ok=True)
        return self.cfg.engine_socket.with_name(f"engine-{self._generation}.sock")

    def _serve_from(self, socket_path: Path, version: str) -> None:
        link = self.cfg.engine_socket
        tmp = link.with_name(link.name + ".next")
        tmp.unlink(missing_ok=True)
        os.symlink(socket_path.name, tmp)
        os.replace(tmp, link)  # atomic: a connect finds the old engine or the new one, never nothing
        self._serving = (socket_path, version)

    async def _spawn(self, cfg: Config, args: list[str], socket_path: Path) -> _Run:
        launch = build_launch(cfg, args, self.internal_key, socket=socket_path)
        log.info("starting engine on unix:%s: %s", socket_path, describe(launch))
        run = _Run(launch, await self._spawn_guard(cfg, launch))
        run.pump = asyncio.create_task(self._pump_logs(run))
        run.exited = asyncio.create_task(_exit_status(run.proc))
        return run

    async def _until_healthy(self, run: _Run, socket_path: Path) -> str | None:
        """None once the engine answers /health; else why not (it exited, or it was stopped when the start-up
        time ran out)."""
        assert run.exited is not None
        timeout = self.cfg.engine.startup_timeout_s
        healthy = asyncio.create_task(self._wait_healthy(socket_path))
        done, _ = await asyncio.wait({run.exited, healthy}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if healthy in done and healthy.result():
            log.info("engine ready on unix:%s", socket_path)
            return None
        healthy.cancel()
        if not done:
            log.error("engine not healthy after %.0fs; stopping it", timeout)
            await self._terminate(run)
            return f"engine did not become healthy within {timeout:g}s"
        self._kill_leftovers(run.pgid)
        await self._drain(run)
        return explain_exit(run.exited.result(), run.tail.recent(EXIT_CONTEXT_S))

    async def _spawn_guard(self, cfg: Config, launch: EngineLaunch) -> asyncio.subprocess.Process:
        """The guard (appliance.engine.guard) in a session of its own, running the launch's argv: it kills
        the engine's whole process group when this daemon dies."""
        argv = [
            self._guard_python, "-m", "appliance.engine.guard",
            "--parent-pid", str(os.getpid()),
            "--grace", str(cfg.engine.stop_grace_s),
            "--", *launch.argv,
        ]
        cfg.engine_cache_dir.mkdir(parents=True, exist_ok=True)
        return await asyncio.create_subprocess_exec(
            *argv,
            env=launch.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            limit=1 << 20,
        )

    async def _drain(self, run: _Run) -> None:
        """The rest of an exited engine's log."""
        if run.pump is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(run.pump), timeout=5)
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

    async def _pump_logs(self, run: _Run) -> None:
        stdout = run.proc.stdout
        assert stdout is not None
        while True:
            try:
                raw = await stdout.readline()
            except ValueError:  # a line longer than the limit: skip it, keep reading
                continue
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip()
            if not line:
                continue
            run.tail.append(line)
            run.backend.feed(line)
            if run is self._current:
                self.status.attention_backend = run.backend.backend
            m = _PGID_RE.search(line)
            if m:
                run.pgid = int(m.group(1))
            engine_log.info("%s", line)

    async def _terminate(self, run: _Run | None) -> None:
        """SIGTERM the guard (it forwards to the engine's group, then SIGKILLs after the grace period)."""
        if run is None:
            return
        proc, pgid = run.proc, run.pgid
        if proc.returncode is not None:
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

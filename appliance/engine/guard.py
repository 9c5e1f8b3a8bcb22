"""The engine guard: a tiny parent for vLLM that guarantees no engine process outlives the appliance.

    python -m appliance.engine.guard --parent-pid PID --grace SECONDS -- <vllm argv...>

Why a separate process: vLLM starts its own children (the EngineCore process),
so PR_SET_PDEATHSIG on the vLLM API server alone would leave the EngineCore
holding the accelerator when the appliance is SIGKILLed. The guard

* starts vLLM as the leader of a new process group, which every process vLLM
  starts inherits, and announces that group so the supervisor can clean up even
  if the guard itself is killed;
* asks the kernel for SIGTERM when its parent (the appliance) dies, however
  it dies, and checks it did not already miss that moment;
* is a child subreaper, so descendants orphaned inside the engine re-parent to
  it instead of to init;
* on SIGTERM/SIGINT/SIGHUP, forwards SIGTERM to the whole group, waits for the
  grace period, then SIGKILLs the group;
* when the vLLM process exits by itself, kills whatever it left in the group
  and exits with vLLM's status (128+N when vLLM died of signal N), after
  printing one line the supervisor uses to explain the death.

Standard library only, and nothing from the appliance, so it starts in
milliseconds and cannot fail on an import.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
EXIT_LINE_PREFIX = "appliance-engine-guard:"


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print(f"{EXIT_LINE_PREFIX} usage: --parent-pid PID --grace S -- CMD...", file=sys.stderr)
        return 2
    sep = argv.index("--")
    opts, cmd = argv[:sep], argv[sep + 1 :]
    parent_pid = int(opts[opts.index("--parent-pid") + 1])
    grace = float(opts[opts.index("--grace") + 1])

    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        return 1

    stopping = {"sig": 0}

    def on_stop(signum: int, _frame: object) -> None:
        stopping["sig"] = signum

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_stop)

    child = _start_engine(cmd)
    status = _wait_for_engine(child, grace, stopping)
    # vLLM is gone: nothing it started may stay behind.
    _kill_group(child, signal.SIGKILL)
    _reap_all()
    return _exit_code(status)


def _start_engine(cmd: list[str]) -> int:
    """The engine in a process group of its own (the guard kills the group), dying with the guard."""
    child = os.fork()
    if child == 0:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)
        os.setpgid(0, 0)
        # Survives exec: if the guard is SIGKILLed, the vLLM front end goes with it.
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        try:
            os.execvp(cmd[0], cmd)
        except OSError as e:
            print(f"{EXIT_LINE_PREFIX} cannot execute {cmd[0]}: {e}", file=sys.stderr, flush=True)
            os._exit(127)
    try:
        os.setpgid(child, child)  # also here, so there is no window where it is unset
    except (PermissionError, ProcessLookupError):
        pass  # the child already did it, or already exec'd / exited
    print(f"{EXIT_LINE_PREFIX} engine pgid {child}", file=sys.stderr, flush=True)
    return child


def _wait_for_engine(child: int, grace: float, stopping: dict[str, int]) -> int | None:
    """The engine's wait status once it ends; a stop signal is passed on as SIGTERM, then SIGKILL after
    `grace` seconds. None when the child was already reaped."""
    forwarded_at = None
    while True:
        if stopping["sig"] and forwarded_at is None:
            _kill_group(child, signal.SIGTERM)
            forwarded_at = time.monotonic()
        if forwarded_at is not None and time.monotonic() - forwarded_at > grace:
            print(f"{EXIT_LINE_PREFIX} engine ignored SIGTERM for {grace:g}s; sending SIGKILL", file=sys.stderr, flush=True)
            _kill_group(child, signal.SIGKILL)
            forwarded_at = float("inf")  # SIGKILL sent once; now only wait
        try:
            pid, st = os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid == child:
            return st
        time.sleep(0.05)


def _exit_code(status: int | None) -> int:
    """The engine's exit status as the guard's own, said on the exit line the supervisor reads."""
    if status is None:
        return 1
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        print(f"{EXIT_LINE_PREFIX} engine killed by signal {signal.Signals(sig).name}", file=sys.stderr, flush=True)
        return 128 + sig
    code = os.WEXITSTATUS(status)
    print(f"{EXIT_LINE_PREFIX} engine exited with status {code}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The orphan guarantee and the restart policy, with real processes (a shell stands in for vLLM here;
the same paths run with the real engine in tests/integration/test_engine_lifecycle.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from appliance.boot import config
from appliance.engine.guard import EXIT_LINE_PREFIX
from appliance.engine.supervisor import EXIT_CONTEXT_S, EngineState, EngineSupervisor, LogTail, explain_exit
from tests.support import REPO, short_private_dir, wait_for


def _guard(cmd: list[str], grace: float = 5, parent: int | None = None) -> list[str]:
    return [sys.executable, "-m", "appliance.engine.guard", "--parent-pid", str(parent or os.getpid()),
            "--grace", str(grace), "--", *cmd]


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def test_guard_reports_exit_status():
    r = subprocess.run(_guard(["sh", "-c", "exit 3"]), capture_output=True, text=True, timeout=30, cwd=REPO)
    assert r.returncode == 3
    assert f"{EXIT_LINE_PREFIX} engine exited with status 3" in r.stderr


def test_guard_reports_death_by_signal():
    r = subprocess.run(_guard(["sh", "-c", "kill -9 $$"]), capture_output=True, text=True, timeout=30, cwd=REPO)
    assert r.returncode == 128 + 9 and "killed by signal SIGKILL" in r.stderr


def test_guard_sigkills_an_engine_that_ignores_sigterm():
    p = subprocess.Popen(_guard(["sh", "-c", "trap '' TERM; sleep 300 & wait"], grace=1), cwd=REPO,
                         stderr=subprocess.PIPE, text=True)
    time.sleep(1)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert "ignored SIGTERM for 1s; sending SIGKILL" in err
    assert p.returncode == 128 + 9 and time.monotonic() - t0 < 10


def test_sigkill_of_the_parent_takes_the_whole_engine_tree_down(tmp_path: Path):
    """The appliance stand-in starts the guard, the 'engine' starts a grandchild; then the parent is SIGKILLed."""
    pidfile = tmp_path / "pids"
    parent_script = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        cmd = [sys.executable, "-m", "appliance.engine.guard", "--parent-pid", str(os.getpid()), "--grace", "5",
               "--", "sh", "-c", "sleep 300 & echo $! >> {pidfile}; echo $$ >> {pidfile}; wait"]
        subprocess.Popen(cmd, start_new_session=True)
        time.sleep(300)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_script], cwd=REPO)
    wait_for(lambda: pidfile.exists() and len(pidfile.read_text().split()) == 2, 20, what="engine pids")
    engine_pids = [int(x) for x in pidfile.read_text().split()]
    guard_pids = [c.pid for c in psutil.Process(parent.pid).children()]
    assert not _gone(engine_pids + guard_pids)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    wait_for(lambda: _gone(engine_pids + guard_pids), 20, what="the engine tree to die with its parent")


def test_explain_exit_gives_an_operator_hint():
    lines = ["loading", "torch.OutOfMemoryError: CUDA out of memory", f"{EXIT_LINE_PREFIX} engine exited with status 1"]
    msg = explain_exit(1, lines)
    assert msg.startswith("engine exited with status 1") and "kv_cache_memory_bytes" in msg
    assert explain_exit(137, [f"{EXIT_LINE_PREFIX} engine killed by signal SIGKILL"]) == "engine killed by signal SIGKILL"
    assert "last error: ValueError: bad" in explain_exit(1, ["ValueError: bad"])


def test_an_old_error_is_not_quoted_as_the_reason_the_engine_died():
    """An error line a request provoked long before the exit (issue 15) is not the exit's cause."""
    now = [0.0]
    tail = LogTail(clock=lambda: now[0])
    tail.append("ValueError: prompt too long for the model")
    now[0] += 20 * 60
    tail.append("RuntimeError: engine core died")
    tail.append(f"{EXIT_LINE_PREFIX} engine exited with status 1")
    reason = explain_exit(1, tail.recent(EXIT_CONTEXT_S))
    assert reason == "engine exited with status 1; last error: RuntimeError: engine core died", reason
    now[0] += 5
    quiet = LogTail(clock=lambda: now[0])
    quiet.append("ValueError: prompt too long for the model")
    now[0] += 20 * 60
    quiet.append(f"{EXIT_LINE_PREFIX} engine exited with status 1")
    assert explain_exit(1, quiet.recent(EXIT_CONTEXT_S)) == "engine exited with status 1"


def test_supervisor_restarts_with_backoff_then_gives_up(tmp_path: Path):
    # /bin/false stands in for the interpreter: every start dies at once with status 1.
    cfg = config.parse(
        f'[model]\npath = "{tmp_path}"\n[state]\ndirectory = "{tmp_path}/state"\n'
        f'[engine]\nsocket_dir = "{short_private_dir()}"\npython = "/bin/false"\nrestart_backoff_initial_s = 0.05\nrestart_backoff_max_s = 0.2\n'
        "max_failures = 3\nfailure_window_s = 60\n"
    )
    seen: list[str] = []

    async def scenario() -> tuple[EngineSupervisor, str]:
        sup = EngineSupervisor(cfg, [])
        sup.add_listener(lambda st: seen.append(st.state.value))
        await sup.start()
        await asyncio.wait_for(sup.gave_up.wait(), 30)
        assert sup.status.state is EngineState.FAILED
        reason = sup.status.reason
        assert not sup.ready
        await sup.stop()
        return sup, reason

    sup, reason = asyncio.run(scenario())
    assert "failed 3 times within 60s; giving up" in reason and "status 1" in reason
    assert seen[:2] == ["starting", "restarting"] and "failed" in seen
    assert sup.status.restarts == 2


def _fake_engine_config(tmp_path: Path, engine_extra: str) -> config.Config:
    """A stand-in 'interpreter' that starts a background child and then never becomes healthy."""
    fake = tmp_path / "fake-python"
    fake.write_text("#!/bin/sh\nsleep 300 &\nexec sleep 300\n")
    fake.chmod(0o755)
    return config.parse(
        f'[model]\npath = "{tmp_path}"\n[state]\ndirectory = "{tmp_path}/state"\n'
        f'[engine]\nsocket_dir = "{short_private_dir()}"\npython = "{fake}"\n{engine_extra}\n'
    )


def test_supervisor_stop_during_start_leaves_nothing(tmp_path: Path):
    cfg = _fake_engine_config(tmp_path, "stop_grace_s = 2")

    async def scenario() -> list[int]:
        sup = EngineSupervisor(cfg, [])
        await sup.start()
        await asyncio.sleep(1.5)
        assert sup.status.state is EngineState.STARTING
        guard = psutil.Process(sup.status.pid)
        pids = [guard.pid] + [c.pid for c in guard.children(recursive=True)]
        assert len(pids) >= 3  # guard, fake engine, its background child
        await sup.stop()
        assert sup.status.state is EngineState.STOPPED
        return pids

    pids = asyncio.run(scenario())
    wait_for(lambda: _gone(pids), 10, what="all engine processes to exit after stop()")


def test_guard_killed_the_supervisor_still_cleans_up_and_restarts(tmp_path: Path):
    """Even if the guard itself is SIGKILLed, its engine's processes (holding the log pipe) are killed."""
    cfg = _fake_engine_config(tmp_path, "restart_backoff_initial_s = 30")

    async def scenario() -> tuple[list[int], str]:
        sup = EngineSupervisor(cfg, [])
        await sup.start()
        await asyncio.sleep(1.5)
        guard = psutil.Process(sup.status.pid)
        engine = [p.pid for p in guard.children(recursive=True)]
        assert len(engine) == 2
        guard.send_signal(signal.SIGKILL)
        for _ in range(100):
            if sup.status.state is EngineState.RESTARTING:
                break
            await asyncio.sleep(0.1)
        reason = sup.status.reason
        await sup.stop()
        return engine, reason

    engine, reason = asyncio.run(scenario())
    assert "engine guard killed by signal SIGKILL" in reason
    wait_for(lambda: _gone(engine), 10, what="the guard's orphans to be killed")


def test_relaunch_with_new_arguments_is_not_a_failure(tmp_path: Path):
    """A decided relaunch (the doctor turning speculation off) restarts at once with the new arguments,
    and neither waits out the back-off nor counts towards giving up."""
    cfg = _fake_engine_config(tmp_path, "restart_backoff_initial_s = 30\nmax_failures = 1")
    seen: list[str] = []

    async def scenario() -> tuple[list[int], EngineSupervisor]:
        sup = EngineSupervisor(cfg, ["--old"])
        sup.add_listener(lambda st: seen.append(f"{st.state.value}: {st.reason}"))
        await sup.start()
        await asyncio.sleep(1.5)
        old = psutil.Process(sup.status.pid)
        old_pids = [old.pid] + [c.pid for c in old.children(recursive=True)]
        assert sup.launch is not None and "--old" in sup.launch.argv
        during_drain: list[tuple[str, bool]] = []

        async def drain() -> None:  # the old engine still runs, but new work is refused (not READY)
            during_drain.append((sup.status.state.value, old.is_running()))

        await sup.relaunch(["--new"], "speculative acceptance decayed", drain=drain)
        assert during_drain == [("restarting", True)]
        for _ in range(100):
            if sup.status.pid not in (None, old.pid):
                break
            await asyncio.sleep(0.1)
        assert sup.status.pid not in (None, old.pid), "no new engine within 10s: the relaunch waited out a back-off"
        assert "--new" in sup.launch.argv and "--old" not in sup.launch.argv
        new = sup.status.pid
        await asyncio.sleep(2)  # the old engine's clean-up must not reach the new engine
        assert sup.status.pid == new and psutil.pid_exists(new), "the new engine was killed after the relaunch"
        assert not sup.gave_up.is_set() and sup.status.restarts == 0 and sup.status.last_exit is None
        await sup.stop()
        return old_pids, sup

    old_pids, _sup = asyncio.run(scenario())
    assert "restarting: relaunching: speculative acceptance decayed" in seen
    wait_for(lambda: _gone(old_pids), 10, what="the old engine to be gone")

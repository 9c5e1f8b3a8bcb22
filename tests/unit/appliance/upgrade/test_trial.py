"""The supervisor's trial launch (an upgrade's swap): the new engine takes traffic only past its gate, and
any failure of it (start, gate, death) brings the previous engine back at once, without counting a failure.
A small HTTP server on the socket stands in for vLLM (fake_engine.py); the real engine runs the same paths in
tests/integration/test_upgrade.py."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import psutil

from appliance.boot import config
from appliance.engine.supervisor import EngineState, EngineSupervisor, Trial
from appliance.upgrade import golden
from tests.support import short_private_dir

FAKE = Path(__file__).with_name("fake_engine.py")


def _model(tmp_path: Path, name: str, answer: str, **files: str) -> Path:
    m = tmp_path / name
    m.mkdir()
    (m / "answer.txt").write_text(answer)
    for f, text in files.items():
        (m / f.replace("_", "-")).write_text(text)
    return m


def _cfg(tmp_path: Path, model: Path) -> config.Config:
    fake = tmp_path / "fake-python"
    if not fake.exists():
        fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
        fake.chmod(0o755)
    return config.parse(
        f'[model]\npath = "{model}"\nserved_name = "m"\n[state]\ndirectory = "{tmp_path}/state"\n'
        f'[engine]\nsocket_dir = "{short_private_dir()}"\npython = "{fake}"\nrestart_backoff_initial_s = 30\n'
        "max_failures = 1\nstop_grace_s = 2\n")


async def _answer(sup: EngineSupervisor, socket: Path | None = None) -> str:
    """An answer from the engine on `socket`, or from the serving one (the configured path links to it)."""
    async with golden.EngineAsker(socket or sup.cfg.engine_socket, sup.internal_key, "m", 10) as asker:
        return (await asker.ask(golden.GoldenCase(prompt="hi"))).text


async def _ready(sup: EngineSupervisor) -> None:
    for _ in range(200):
        if sup.ready:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"engine not ready: {sup.status.reason}")


async def _outcome(trial: Trial) -> str | None:
    await asyncio.wait({trial.serving, trial.failed}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    assert trial.serving.done() or trial.failed.done(), "the trial neither served nor failed in 30s"
    return trial.failed.result() if trial.failed.done() else None


def _run_trial(tmp_path: Path, new_model: Path, gate_says: str | None, then=None) -> tuple[str | None, str, list[str]]:
    """Start on 'old', try new_model with a gate that says gate_says; returns the trial's failure, what answers
    afterwards, and the states the supervisor went through."""
    old_cfg = _cfg(tmp_path, _model(tmp_path, "old", "old answer"))
    seen: list[str] = []

    async def scenario() -> tuple[str | None, str]:
        sup = EngineSupervisor(old_cfg, ["--old"], version="sha256:old")
        sup.add_listener(lambda st: seen.append(st.state.value))
        await sup.start()
        await _ready(sup)
        gated: list[str] = []

        async def gate(socket: Path) -> str | None:
            gated.append(await _answer(sup, socket))  # the gate sees the new engine, not yet the clients
            assert sup.status.state is EngineState.RESTARTING
            return gate_says

        trial = await sup.try_launch(old_cfg.model_copy(update={"model": old_cfg.model.model_copy(
            update={"path": new_model})}), ["--new"], "sha256:new", "test", None, gate)
        failed = await _outcome(trial)
        if then is not None:
            failed = await then(sup, trial) or failed
        await _ready(sup)
        answer = await _answer(sup)
        assert not sup.gave_up.is_set() and sup.status.restarts == 0, "a trial's failure counted as a crash"
        if failed is not None:
            assert sup.version == "sha256:old" and "--old" in (sup.launch.argv if sup.launch else [])
        await sup.stop()
        return failed, answer

    failed, answer = asyncio.run(scenario())
    return failed, answer, seen


def test_a_new_engine_past_its_gate_serves(tmp_path: Path):
    failed, answer, _ = _run_trial(tmp_path, _model(tmp_path, "new", "new answer"), None)
    assert failed is None and answer == "new answer"


def test_a_gate_that_fails_brings_the_old_engine_back(tmp_path: Path):
    failed, answer, seen = _run_trial(tmp_path, _model(tmp_path, "new", "garbage"), "answers garbage")
    assert failed is not None and "failed its gate: answers garbage" in failed
    assert answer == "old answer"
    assert "failed" not in seen


def test_a_new_engine_that_exits_at_once_brings_the_old_one_back(tmp_path: Path):
    failed, answer, _ = _run_trial(tmp_path, _model(tmp_path, "new", "x", exit_at_once="1"), None)
    assert failed is not None and "status 3" in failed
    assert answer == "old answer"


def test_a_new_engine_that_dies_on_trial_brings_the_old_one_back(tmp_path: Path):
    async def probation(sup: EngineSupervisor, trial: Trial) -> str | None:
        assert trial.serving.done() and await _answer(sup) == "new answer"
        return await asyncio.wait_for(trial.failed, 30)

    failed, answer, _ = _run_trial(tmp_path, _model(tmp_path, "new", "new answer", die_after="1"), None, probation)
    assert failed is not None and "status 4" in failed
    assert answer == "old answer"


def test_abandoning_a_serving_trial_goes_back(tmp_path: Path):
    async def abandon(sup: EngineSupervisor, trial: Trial) -> str | None:
        await sup.abandon_trial("too many errors")
        return await asyncio.wait_for(trial.failed, 1)

    failed, answer, _ = _run_trial(tmp_path, _model(tmp_path, "new", "new answer"), None, abandon)
    assert failed == "too many errors" and answer == "old answer"


def _run_beside(tmp_path: Path, new_model: Path, gate_says: str | None, then) -> tuple[str | None, list[str]]:
    old_cfg = _cfg(tmp_path, _model(tmp_path, "old", "old answer"))
    seen: list[str] = []

    async def scenario() -> str | None:
        sup = EngineSupervisor(old_cfg, ["--old"], version="sha256:old")
        await sup.start()
        await _ready(sup)
        sup.add_listener(lambda st: seen.append(st.state.value))
        old_pid = sup.status.pid

        async def gate(socket: Path) -> str | None:
            assert await _answer(sup) == "old answer", "the running engine stopped serving during the gate"
            assert await _answer(sup, socket) in ("new answer", "garbage")
            return gate_says

        new_cfg = old_cfg.model_copy(update={"model": old_cfg.model.model_copy(update={"path": new_model})})
        trial = await sup.try_beside(new_cfg, ["--new"], "sha256:new", "test", gate)
        failed = await _outcome(trial)
        result = await then(sup, trial, failed, old_pid)
        await sup.stop()
        return result

    return asyncio.run(scenario()), seen


def test_beside_the_new_engine_takes_new_requests_and_the_old_one_retires(tmp_path: Path):
    async def then(sup: EngineSupervisor, trial: Trial, failed: str | None, old_pid: int) -> str | None:
        assert failed is None
        endpoint = sup.endpoint()
        assert endpoint is not None and endpoint[1] == "sha256:new" and sup.version == "sha256:new"
        assert await _answer(sup) == "new answer"  # the configured path now reaches the new engine
        assert sup.status.pid == old_pid  # still watching the old one, which finishes what it has
        drained: list[bool] = []

        async def drain() -> None:
            drained.append(True)

        await sup.retire_previous(drain)
        for _ in range(100):
            if sup.status.pid not in (None, old_pid):
                break
            await asyncio.sleep(0.05)
        assert drained == [True] and sup.status.pid not in (None, old_pid), "the loop did not adopt the new engine"
        assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE
        assert sup.ready and sup.status.restarts == 0 and await _answer(sup) == "new answer"
        sup.end_trial()
        return None

    failed, seen = _run_beside(tmp_path, _model(tmp_path, "new", "new answer"), None, then)
    assert failed is None and "restarting" not in seen, seen  # no request was ever held


def test_beside_a_new_engine_failing_its_gate_never_disturbs_the_running_one(tmp_path: Path):
    async def then(sup: EngineSupervisor, trial: Trial, failed: str | None, old_pid: int) -> str | None:
        assert sup.status.pid == old_pid and sup.ready and sup.version == "sha256:old"
        assert await _answer(sup) == "old answer" and not sup.on_trial
        return failed

    failed, seen = _run_beside(tmp_path, _model(tmp_path, "new", "garbage"), "answers garbage", then)
    assert failed is not None and "failed its gate: answers garbage" in failed
    assert "restarting" not in seen, seen


def test_beside_a_new_engine_that_cannot_start_leaves_the_running_one(tmp_path: Path):
    async def then(sup: EngineSupervisor, trial: Trial, failed: str | None, old_pid: int) -> str | None:
        assert sup.status.pid == old_pid and await _answer(sup) == "old answer"
        return failed

    failed, seen = _run_beside(tmp_path, _model(tmp_path, "new", "x", exit_at_once="1"), None, then)
    assert failed is not None and "failed to start" in failed and "status 3" in failed
    assert "restarting" not in seen, seen

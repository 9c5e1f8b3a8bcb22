"""Supervisor behaviour with the real engine: death detected, 503 while down, restart, no orphans ever."""

from __future__ import annotations

import signal

import httpx
import psutil
import pytest

from tests.support import RunningAppliance, start_appliance, wait_for

pytestmark = pytest.mark.engine


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _engine_core_started(app: RunningAppliance) -> list[psutil.Process] | None:
    procs = app.engine_processes()
    names = " ".join(p.name() + " " + " ".join(p.cmdline()) for p in _alive(procs))
    return procs if "EngineCore" in names and "api_server" in names else None


@pytest.fixture()
def fresh(tmp_path) -> RunningAppliance:
    app = start_appliance(tmp_path)
    yield app
    app.stop(signal.SIGKILL)


def test_engine_death_is_detected_served_503_then_healed_then_clean_stop(fresh: RunningAppliance):
    fresh.wait_ready()
    body = {"model": fresh.served_name, "prompt": "Hello", "max_tokens": 2}
    assert httpx.post(f"{fresh.url}/v1/completions", json=body, timeout=60).status_code == 200

    api_server = next(p for p in fresh.engine_processes() if "api_server" in " ".join(p.cmdline()))
    api_server.send_signal(signal.SIGKILL)

    r = wait_for(lambda: (x := httpx.get(f"{fresh.url}/readyz")).status_code == 503 and x, 10,
                 what="/readyz to turn 503")
    engine = r.json()["engine"]
    assert engine["state"] == "restarting" and "SIGKILL" in engine["reason"]
    assert r.headers["retry-after"] == "3"

    r = httpx.post(f"{fresh.url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["code"] == "engine_not_ready"

    # Self-healing: the supervisor starts a new engine and the API serves again.
    fresh.wait_ready(timeout=300)
    assert httpx.get(f"{fresh.url}/readyz").json()["engine"]["restarts"] == 1
    assert httpx.post(f"{fresh.url}/v1/completions", json=body, timeout=60).status_code == 200

    # Clean stop: exit status 0 and nothing of the engine left.
    engine_procs = fresh.engine_processes()
    assert _alive(engine_procs)
    everything = fresh.descendants()
    assert fresh.stop(signal.SIGTERM) == 0
    assert _alive(everything) == []
    log = fresh.log_text()
    assert "stopping the engine" in log and "INFO    appliance: stopped" in log


def test_appliance_sigkill_leaves_no_engine_behind(fresh: RunningAppliance):
    # Kill while the engine is up with its EngineCore child: the case PR_SET_PDEATHSIG alone misses.
    procs = wait_for(lambda: _engine_core_started(fresh), 300, interval=0.5, what="the EngineCore process")
    everything = fresh.descendants()
    assert len(_alive(procs)) >= 2
    fresh.proc.send_signal(signal.SIGKILL)
    fresh.proc.wait(10)
    wait_for(lambda: _alive(everything) == [], 30, what="every engine process to exit")

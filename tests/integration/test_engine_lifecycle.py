"""Supervisor behaviour with the real engine: death detected, requests held while it restarts (503 past
their class's bound), restart, no orphans ever."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
import pytest

from appliance.store import keys
from tests import loopback
from tests.support import NotifyListener, RunningAppliance, start_appliance, wait_for

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


def _running_requests(app: RunningAppliance) -> float:
    try:
        text = app.engine_get("/metrics", timeout=2).text
    except httpx.HTTPError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _engine_core_started(app: RunningAppliance) -> list[psutil.Process] | None:
    """The engine's processes once both the API server and its EngineCore child run, else None."""
    procs = app.engine_processes()
    names = " ".join(p.name() + " " + " ".join(p.cmdline()) for p in _alive(procs))
    return procs if "EngineCore" in names and "api_server" in names else None


def _all_exit(procs: list[psutil.Process], what: str) -> None:
    """Every process recorded before a kill is gone (psutil tells a reused pid from the recorded one)."""
    wait_for(lambda: _alive(procs) == [], 30, what=what,
             explain=lambda: "still running: " + "; ".join(f"{p.pid} {p.name()}" for p in _alive(procs)))


@pytest.fixture()
def notify(tmp_path) -> NotifyListener:
    listener = NotifyListener(tmp_path / "notify.sock")
    yield listener
    listener.close()


@pytest.fixture()
def fresh(tmp_path, notify) -> RunningAppliance:
    # Anonymous requests are silver, held up to server.restart_hold_s (240 s here: a CPU engine's restart
    # on a busy 2-core box may pass the default 60 s); bronze's own bound is 1 s, so a bronze request sees
    # the 503 a restart gives past the hold.
    app = start_appliance(tmp_path / "app", env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "2000000"},
                          server_extra="restart_hold_s = 240",
                          extra="[admission.classes.bronze]\nrestart_hold_s = 1\n")
    yield app
    app.stop(signal.SIGKILL)


def test_engine_death_is_detected_served_503_then_healed_then_clean_stop(fresh: RunningAppliance,
                                                                          notify: NotifyListener):
    fresh.wait_ready()
    # systemd: progress while starting, READY=1 only once the engine answers and the API listens
    wait_for(lambda: notify.has("READY=1"), 10, what="READY=1")
    ready_at = notify.index("READY=1")
    assert notify.index("STATUS=starting") < ready_at and notify.index("EXTEND_TIMEOUT_USEC=") < ready_at
    assert "STATUS=serving: smollm2-135m-instruct" in notify.messages[ready_at]
    wait_for(lambda: notify.messages.count("WATCHDOG=1") >= 2, 10, what="watchdog pings at half WATCHDOG_USEC")
    body = {"model": fresh.served_name, "prompt": "Hello", "max_tokens": 2}
    assert loopback.post(f"{fresh.url}/v1/completions", json=body, timeout=60).status_code == 200

    # Streams in flight when the engine dies must each end, promptly, with a clear error event.
    outcomes: dict[int, str] = {}

    def stream(i: int) -> None:
        long = {"model": fresh.served_name, "prompt": f"Story {i}:", "max_tokens": 1500, "ignore_eos": True,
                "stream": True}
        try:
            with loopback.stream("POST", f"{fresh.url}/v1/completions", json=long, timeout=60) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            outcomes[i] = "error-event" if any('"engine_stream_broken"' in line for line in lines) else "ended"
        except httpx.HTTPError as e:
            outcomes[i] = f"transport error {type(e).__name__}"

    streams = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in streams:
        t.start()
    wait_for(lambda: _running_requests(fresh) >= 4, 30, what="four streams running in the engine")

    engine = _engine_core_started(fresh)
    assert engine, "the API server and its EngineCore, recorded before the kill"
    api_server = next(p for p in engine if "api_server" in " ".join(p.cmdline()))
    killed_at = time.monotonic()
    api_server.send_signal(signal.SIGKILL)
    for t in streams:
        t.join(30)
    assert all(not t.is_alive() for t in streams), "a client stream hung after the engine died"
    assert time.monotonic() - killed_at < 30
    assert outcomes == {i: "error-event" for i in range(4)}, outcomes
    _all_exit(engine, "the killed engine's EngineCore (and every other process of it) to exit")

    r = wait_for(lambda: (x := loopback.get(f"{fresh.url}/readyz")).status_code == 503 and x, 10,
                 what="/readyz to turn 503")
    engine = r.json()["engine"]
    assert engine["state"] == "restarting" and "SIGKILL" in engine["reason"]
    assert r.headers["retry-after"] == "3"

    # A silver request now is held until the engine is back, then answered; a bronze one gets the
    # engine's 503 with Retry-After once its class's 1 s bound has passed.
    held: list[httpx.Response] = []  # sent after /readyz said 503: only the new engine can answer it
    holder = threading.Thread(target=lambda: held.append(
        loopback.post(f"{fresh.url}/v1/completions", json=body, timeout=300)))
    holder.start()
    _, bronze = keys.create(fresh.database, "bronze-client", priority_class="bronze")
    t = time.monotonic()
    r = loopback.post(f"{fresh.url}/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {bronze}"})
    assert r.status_code == 503 and r.headers["retry-after"] == "3", r.text
    assert r.json()["error"]["code"] == "engine_not_ready" and time.monotonic() - t >= 1.0

    assert wait_for(lambda: notify.has("STATUS=degraded: engine restarting", ready_at), 10, what="degraded STATUS")
    pings_before = notify.messages.count("WATCHDOG=1")
    # Self-healing: the supervisor starts a new engine and the API serves again.
    fresh.wait_ready(timeout=300)
    holder.join(120)
    assert not holder.is_alive(), "the held request was not answered after the engine came back"
    assert held[0].status_code == 200, held[0].text
    metrics = loopback.get(f"{fresh.url}/metrics").text
    assert 'appliance_restart_holds_total{class="silver",outcome="served"} 1.0' in metrics
    assert 'appliance_restart_holds_total{class="bronze",outcome="timed_out"} 1.0' in metrics
    assert notify.messages.count("WATCHDOG=1") > pings_before, "an engine restart is no reason to stop pinging"
    wait_for(lambda: notify.has("STATUS=serving", ready_at + 1), 10, what="serving STATUS after the restart")
    assert notify.messages.count("READY=1\n" + notify.messages[ready_at].split("\n", 1)[1]) == 1

    # SIGHUP: RELOADING=1, then READY=1 again
    mark = len(notify.messages)
    fresh.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: notify.has("READY=1", mark), 10, what="READY=1 after the reload")
    assert notify.index("RELOADING=1", mark) < notify.index("READY=1", mark)
    assert loopback.get(f"{fresh.url}/readyz").json()["engine"]["restarts"] == 1
    assert loopback.post(f"{fresh.url}/v1/completions", json=body, timeout=60).status_code == 200

    # Clean stop: exit status 0 and nothing of the engine left.
    engine_procs = fresh.engine_processes()
    assert _alive(engine_procs)
    everything = fresh.descendants()
    assert fresh.stop(signal.SIGTERM) == 0
    assert _alive(everything) == []
    log = fresh.log_text()
    assert "stopping the engine" in log and "INFO    appliance: stopped" in log
    assert notify.has("STOPPING=1")


def test_appliance_sigkill_leaves_no_engine_behind(fresh: RunningAppliance):
    # Kill while the engine is up with its EngineCore child: the case PR_SET_PDEATHSIG alone misses.
    procs = wait_for(lambda: _engine_core_started(fresh), 300, interval=0.5, what="the EngineCore process")
    everything = fresh.descendants()  # the guard, the API server, its EngineCore
    assert set(procs) <= set(everything) and len(_alive(everything)) >= 3
    fresh.proc.send_signal(signal.SIGKILL)
    fresh.proc.wait(10)
    _all_exit(everything, "every engine process to exit")


def test_guard_sigkill_leaves_no_engine_behind_and_the_engine_comes_back(fresh: RunningAppliance):
    """The guard is what kills the engine's tree; SIGKILLed itself, the supervisor must do it instead."""
    fresh.wait_ready()
    engine = _engine_core_started(fresh)
    assert engine, "the API server and its EngineCore, recorded before the kill"
    fresh.guard().send_signal(signal.SIGKILL)
    _all_exit(engine, "every process of the engine whose guard was killed to exit")
    r = wait_for(lambda: (x := loopback.get(f"{fresh.url}/readyz")).status_code == 503 and x, 30,
                 what="/readyz to turn 503")
    assert "engine guard killed by signal SIGKILL" in r.json()["engine"]["reason"], r.json()
    fresh.wait_ready(timeout=300)  # self-healing: a new guard and a new engine
    body = {"model": fresh.served_name, "prompt": "Hello", "max_tokens": 2}
    assert loopback.post(f"{fresh.url}/v1/completions", json=body, timeout=60).status_code == 200


def test_an_engine_that_keeps_failing_ends_in_status_failed_and_exit_1(tmp_path, notify: NotifyListener):
    """The real engine refusing its command line (an unknown flag) every time: the supervisor gives up, systemd
    reads why in STATUS=, and the exit status 1 lets Restart= and the operator see it."""
    app = start_appliance(tmp_path / "app", env={"NOTIFY_SOCKET": notify.path},
                          engine_extra='extra_args = ["--no-such-vllm-flag"]\nmax_failures = 2')
    try:
        assert app.proc.wait(180) == 1, app.log_text()[-3000:]
    finally:
        app.stop(signal.SIGKILL)
    failed = [m for m in notify.messages if m.startswith("STATUS=failed: ")]
    assert failed and "failed 2 times" in failed[-1] and "giving up" in failed[-1], notify.messages
    assert not notify.has("READY=1") and notify.has("STOPPING=1")
    assert "--no-such-vllm-flag" in app.log_text()  # the engine's own complaint reaches the log

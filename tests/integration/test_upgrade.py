"""Upgrades on a serving box, with the real engine (issue 33): streaming clients through a swap lose nothing,
each build that fails rolls back by itself, a rollback on demand, a daemon killed mid-upgrade comes back on
the committed version, and the route needs admin scope.

One daemon for the module, keys required (as off loopback). Order matters and is the file's: each test
leaves the box serving a known version. Builds of the default model are made in seconds (tests/model_builds.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from appliance.store import keys
from tests import loopback, model_builds
from tests.support import (
    REPO,
    RunningAppliance,
    default_model_path,
    launch_appliance,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.engine

# The whole swap (drain, load, gate) and a rollback after a failed gate (a second load) fit in it on 2 cores.
HOLD_S = 240
PROBATION_S = 5


@dataclass
class Box:
    directory: Path
    config: Path
    app: RunningAppliance
    user: str  # an ordinary key
    admin: str  # an admin key
    builds: dict[str, Path] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)

    def call(self, method: str, path: str, key: str | None = None, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key or self.admin}"}
        return loopback.client(timeout=60).request(method, f"{self.app.url}{path}", headers=headers, **kw)

    def upgrade_status(self) -> dict:
        return self.call("GET", "/v1/appliance/upgrade").json()

    def start_upgrade(self, build: str, **extra) -> dict:
        body = {"model": str(self.builds[build]), "digest": self.digests[build], **extra}
        r = self.call("POST", "/v1/appliance/upgrade", json=body)
        assert r.status_code == 202, r.text
        return r.json()["started"]

    def finished(self, attempt_id: str, timeout: float = 600) -> dict:
        def ended():
            st = self.upgrade_status()
            last = st.get("last")
            return (st["running"] is None and last and last["id"] == attempt_id) and last
        return wait_for(ended, timeout, interval=1, what=f"upgrade {attempt_id} to end",
                        explain=lambda: json.dumps(self.upgrade_status())[:2000])

    def serving_digest(self) -> str:
        return self.call("GET", "/v1/appliance/status").json()["model"]["digest"]


@pytest.fixture(scope="module")
def box(tmp_path_factory) -> Box:
    d = tmp_path_factory.mktemp("upgrade")
    src = default_model_path()
    builds = {"fp16": model_builds.converted(src, d / "builds" / "fp16"),
              "garbled": model_builds.garbled(src, d / "builds" / "garbled"),
              "truncated": model_builds.truncated(src, d / "builds" / "truncated")}
    cfg = write_config(d, server_extra=f"restart_hold_s = {HOLD_S}",
                       extra=f'[auth]\nrequire_keys = "always"\n[upgrade]\nprobation_s = {PROBATION_S}\n'
                             "drain_s = 60\n")
    state = d / "state"
    state.mkdir()
    _, user = keys.create(state / "appliance.db", "app")
    _, admin = keys.create(state / "appliance.db", "ops", admin=True)
    app = launch_appliance(cfg, d)
    app.wait_ready()
    b = Box(d, cfg, app, user, admin, builds, {k: model_builds.digest(v) for k, v in builds.items()})
    b.digests["default"] = b.serving_digest()
    yield b
    b.app.stop()


class Clients:
    """N clients streaming chat answers back to back through the appliance, every outcome kept."""

    def __init__(self, box: Box, n: int) -> None:
        self.box, self.stop = box, threading.Event()
        self.results: list[dict] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        body = {"model": self.box.app.served_name, "stream": True, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": f"Tell me a fact about the number {i}."}]}
        headers = {"Authorization": f"Bearer {self.box.user}"}
        while not self.stop.is_set():
            started = time.time()
            rec: dict = {"client": i, "started": started}
            try:
                with loopback.stream("POST", f"{self.box.app.url}/v1/chat/completions", json=body, headers=headers,
                                     timeout=HOLD_S + 120) as r:
                    rec |= {"status": r.status_code, "digest": r.headers.get("x-appliance-model-digest")}
                    lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                rec["complete"] = bool(lines) and lines[-1] == "data: [DONE]" and not any(
                    '"error"' in line for line in lines)
            except httpx.HTTPError as e:
                rec |= {"status": None, "error": repr(e), "complete": False}
            rec["ended"] = time.time()
            self.results.append(rec)

    def finish(self) -> list[dict]:
        self.stop.set()
        for t in self.threads:
            t.join(HOLD_S + 180)
        assert not any(t.is_alive() for t in self.threads), "a client hung"
        return self.results

    @staticmethod
    def failed(results: list[dict]) -> list[dict]:
        return [r for r in results if r.get("status") != 200 or not r.get("complete")]


def test_a_refused_upgrade_leaves_the_running_engine_untouched_and_the_route_needs_admin(box: Box):
    pid = box.app.guard().pid
    body = {"model": str(box.builds["fp16"]), "digest": box.digests["garbled"]}  # the wrong pin
    r = box.call("POST", "/v1/appliance/upgrade", key=box.user, json=body)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_scope_required"
    r = box.call("POST", "/v1/appliance/upgrade", json={"model": str(box.builds["fp16"]), "digest": "sha256:xyz"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_upgrade"
    r = box.call("POST", "/v1/appliance/rollback")
    assert r.status_code == 409 and "no previous version" in r.json()["error"]["message"]
    attempt = box.call("POST", "/v1/appliance/upgrade", json=body).json()["started"]
    last = box.finished(attempt["id"], 120)
    assert last["result"] == "refused" and last["step"] == "stage"
    assert "does not match its pin" in last["reason"]
    assert box.app.guard().pid == pid, "a refused upgrade restarted the engine"
    assert box.serving_digest() == box.digests["default"]


def test_eight_streaming_clients_lose_nothing_through_an_upgrade(box: Box):
    """The CPU engine swaps in place under upgrade.swap = auto (appliance/upgrade/swap.py says why): new
    requests are held while the new engine loads and passes its gate, then answered by it. The clients
    stream from the swap on: staging touches no engine, and under load on 2 cores vLLM's probe gets little
    CPU (minutes instead of seconds)."""
    attempt = box.start_upgrade("fp16")
    _step_is(box, "swap")
    clients = Clients(box, 8)
    assert box.upgrade_status()["running"]["swap"] == "in_place"
    last = box.finished(attempt["id"])
    committed_at = time.time()
    wait_for(lambda: sum(r["started"] > committed_at for r in clients.results) >= 8, 120,
             what="answers after the commit")
    results = clients.finish()
    assert last["result"] == "committed", last
    assert Clients.failed(results) == [], Clients.failed(results)[:5]
    old, new = box.digests["default"], box.digests["fp16"]
    assert new in {r["digest"] for r in results} <= {old, new}  # the old engine's, or held for the new one
    assert all(r["digest"] == new for r in results if r["started"] > committed_at)
    assert box.serving_digest() == new
    status = box.upgrade_status()
    assert status["committed"].startswith(str(box.builds["fp16"])) and status["previous"].startswith(
        str(default_model_path()))
    metrics = box.call("GET", "/metrics").text
    assert 'appliance_upgrades_total{kind="upgrade",result="committed"} 1.0' in metrics
    assert f'appliance_model_version_info{{digest="{new}"' in metrics
    assert 'appliance_restart_holds_total{class="silver",outcome="served"}' in metrics  # held, then served
    assert 'outcome="timed_out"' not in metrics
    versions = json.loads((box.directory / "state" / "versions.json").read_text())
    assert versions["committed"]["model_digest"] == new


def test_the_cli_rolls_back_to_the_previous_version_on_demand(box: Box):
    cli = subprocess.Popen([sys.executable, "-m", "appliance.cli", "rollback", "--config",
                            str(box.config), "--key", box.admin], cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    _step_is(box, "swap")
    clients = Clients(box, 2)
    out, _ = cli.communicate(timeout=900)
    run = subprocess.CompletedProcess(cli.args, cli.returncode, out, "")
    results = clients.finish()
    assert run.returncode == 0, run.stdout + run.stderr
    assert "rollback committed at commit" in run.stdout and "  gate " in run.stdout and "in place" in run.stdout
    assert Clients.failed(results) == []
    assert box.serving_digest() == box.digests["default"]
    out = subprocess.run([sys.executable, "-m", "appliance.cli", "versions", "--config", str(box.config),
                          "--key", box.admin], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    assert f"previous:  {box.builds['fp16']}" in out


def _exits_at_once(box: Box) -> str:
    """An engine interpreter that answers vLLM's probe (staging passes) but whose API server exits at once."""
    script = box.directory / "engine-that-exits"
    script.write_text("#!/bin/sh\ncase \" $* \" in *\" vllm.entrypoints.openai.api_server \"*)\n"
                      "  echo 'simulated: this engine cannot start' >&2; exit 3;;\nesac\n"
                      f'exec "{sys.executable}" "$@"\n')
    script.chmod(0o755)
    return str(script)


STEPS = ["stage", "swap", "gate", "probation", "commit", "rollback"]


def _step_is(box: Box, step: str) -> None:
    """Until the upgrade under way has reached `step` (or a later one), or has ended: a step can pass
    between two polls (an engine that exits at once ends the swap in 0.1 s)."""
    def reached() -> bool:
        running = box.upgrade_status()["running"]
        return running is None or STEPS.index(running["step"]) >= STEPS.index(step)
    wait_for(reached, 900, interval=0.2, what=f"the upgrade's {step}")


def _kill_the_engine_in_probation(box: Box) -> float:
    _step_is(box, "probation")
    api = next(p for p in box.app.engine_processes() if "api_server" in " ".join(p.cmdline()))
    api.send_signal(signal.SIGKILL)
    return time.time()


FAILURES = {
    # build, extra body, what the outcome's step and reason say, what to do in probation. The first three
    # start the new engine beside the serving one (asked for: auto swaps the CPU engine in place), which
    # must serve on untouched when the new one fails; the last swaps in place.
    "garbled": ("garbled", {"swap": "beside"}, "gate", "agree", None),
    "truncated": ("truncated", {"swap": "beside"}, "swap", "new engine failed to start", None),
    "exits": ("fp16", {"engine_python": "exits", "swap": "beside"}, "swap", "status 3", None),
    "dies_in_probation": ("fp16", {}, "probation", "failed in probation", _kill_the_engine_in_probation),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_a_build_that_fails_rolls_back_by_itself(box: Box, case: str):
    build, extra, step, reason, in_probation = FAILURES[case]
    if extra.get("engine_python") == "exits":
        extra = {**extra, "engine_python": _exits_at_once(box)}
    pid = box.app.guard().pid
    attempt = box.start_upgrade(build, **extra)
    # The clients start with the swap: staging under load only takes longer on 2 cores (the busy engine
    # leaves vLLM's probe little CPU), and the eight-client test already streams through one.
    _step_is(box, "swap")
    clients = Clients(box, 4)
    killed = in_probation(box) if in_probation is not None else None
    last = box.finished(attempt["id"])
    results = clients.finish()
    assert last["result"] == "rolled_back" and last["step"] == step and reason in last["reason"], last
    failed = Clients.failed(results)
    if killed is not None:
        # Streams the killed engine was giving end with an error (the client resends); nothing else fails:
        # requests after the kill wait for the previous engine, even before the supervisor saw the death.
        failed = [r for r in failed if not r["started"] < killed < r["ended"]]
    assert failed == [], failed[:5]
    assert {r["digest"] for r in results} <= {box.digests["default"], box.digests["fp16"]}
    assert box.serving_digest() == box.digests["default"]
    if killed is None:  # beside: the running engine served throughout and was never restarted
        assert box.app.guard().pid == pid
        assert all(r["digest"] == box.digests["default"] for r in results)
    doctor = box.call("GET", "/v1/appliance/doctor").json()["findings"]
    finding = next(f for f in doctor if f["check"] == "upgrade")
    assert finding["status"] == "warn" and "rolled back" in finding["summary"]


@pytest.mark.parametrize("step", ["swap", "probation"])
def test_a_daemon_killed_mid_upgrade_comes_back_on_the_committed_version(box: Box, step: str):
    attempt = box.start_upgrade("fp16")
    _step_is(box, step)
    box.app.stop(signal.SIGKILL)
    log = box.directory / f"appliance-before-kill-at-{step}.log"
    log.write_bytes(box.app.log_path.read_bytes())
    box.app = launch_appliance(box.config, box.directory)
    box.app.wait_ready()
    assert box.serving_digest() == box.digests["default"]
    last = box.upgrade_status()["last"]
    assert last["id"] == attempt["id"] and last["result"] == "interrupted" and last["step"] == step, last
    assert "the committed version serves" in last["reason"]
    assert "ended when the daemon stopped: interrupted" in box.app.log_text()

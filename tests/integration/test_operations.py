"""What an operator does to a running appliance (the session's real one): reload the configuration with
SIGHUP (log_prompts applies at once; an invalid file is refused and the running configuration kept) and
read the request log with `appliance requests`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests import loopback
from tests.integration.test_openai_api import _rows
from tests.regional import marker
from tests.support import REPO, RunningAppliance, wait_for

pytestmark = pytest.mark.engine


def _reload(app: RunningAppliance, outcome: str) -> None:
    """SIGHUP, then wait for the daemon to say `outcome` once more than before."""
    before = app.log_text().count(outcome)
    app.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: app.log_text().count(outcome) > before, 15, what=f"'{outcome}' after SIGHUP")


@contextmanager
def _config_text(app: RunningAppliance, text: str, outcome: str) -> Iterator[None]:
    """The configuration file says `text` (reloaded) for the block; then the original again (reloaded)."""
    original = app.config.read_text()
    app.config.write_text(text)
    try:
        _reload(app, outcome)
        yield
    finally:
        app.config.write_text(original)
        _reload(app, "configuration reloaded")


def _ask(app: RunningAppliance, text: str) -> str:
    rid = f"req-ops-{time.time_ns()}"
    r = loopback.post(f"{app.url}/v1/chat/completions", headers={"X-Request-Id": rid}, timeout=60,
                      json={"model": app.served_name, "messages": [{"role": "user", "content": text}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    return rid


def _row(app: RunningAppliance, rid: str) -> dict:
    return wait_for(lambda: next((r for r in _rows(app) if r["id"] == rid), None), 10, what=f"the row of {rid}")


def test_log_prompts_is_applied_by_a_reload(appliance: RunningAppliance):
    off = _row(appliance, _ask(appliance, f"Repeat {marker()}"))
    assert off["prompt"] is None and off["completion"] is None  # the session appliance's default
    text = appliance.config.read_text()
    assert "log_prompts" not in text
    with _config_text(appliance, text.replace("[state]\n", "[state]\nlog_prompts = true\n"), "configuration reloaded"):
        m = marker()
        on = _row(appliance, _ask(appliance, f"Repeat {m}"))
        assert on["prompt"] is not None and m in on["prompt"] and on["completion"], on
    after = _row(appliance, _ask(appliance, f"Repeat {marker()}"))
    assert after["prompt"] is None, "reloading the original file turns text logging off again"


def test_a_reload_with_an_invalid_file_is_refused_and_the_running_configuration_kept(appliance: RunningAppliance):
    text = appliance.config.read_text()
    broken = text.replace("[state]\n", "[state]\nlog_prompts = \"sometimes\"\n")
    with _config_text(appliance, broken, "reload refused, keeping the running configuration"):
        said = "\n".join(appliance.log_text().split("reload refused")[-1].splitlines()[:3])
        assert "state.log_prompts" in said and "sometimes" in said, said  # names the key and the bad value
        assert loopback.get(f"{appliance.url}/readyz", timeout=10).status_code == 200
        row = _row(appliance, _ask(appliance, f"Still serving {marker()}"))
        assert row["status"] == 200 and row["prompt"] is None


def _requests_cli(app: RunningAppliance, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance.cli", "requests", "--config", str(app.config), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=60)


def test_appliance_requests_shows_the_latest_rows(appliance: RunningAppliance):
    rid = _ask(appliance, "Say yes.")
    _row(appliance, rid)
    r = _requests_cli(appliance, "--json", "--limit", "3")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 3 and rows[0]["id"] == rid and rows[0]["status"] == 200  # newest first
    assert rows[0]["route"] == "/v1/chat/completions" and rows[0]["completion_tokens"] >= 1
    table = _requests_cli(appliance, "--limit", "1")
    assert table.returncode == 0, table.stderr
    head, line = table.stdout.splitlines()
    assert head.split()[:2] == ["id", "status"] and line.split()[:2] == [rid, "200"]

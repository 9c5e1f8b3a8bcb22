"""The status page of the session's running appliance, rendered by a real browser (Chromium, headless):
what a technician at the box sees is the live model, plan and doctor. The screenshot is kept under
build/test-artifacts/ for a person to look at."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from tests import loopback
from tests.support import REPO, RunningAppliance, require_tool, wait_for

pytestmark = pytest.mark.engine

ARTIFACTS = REPO / "build/test-artifacts"


def _browser() -> str:
    """Debian's Chromium: its headless shell (what `make test` installs), or the full browser."""
    return shutil.which("chromium") or require_tool("chromium-headless-shell")


def _chromium(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # --no-sandbox: CI runs as root, where Chromium's sandbox will not start; the page is our own
    r = subprocess.run([_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        f"--user-data-dir={cwd / 'profile'}", *args], capture_output=True, text=True, timeout=120,
                       cwd=cwd)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


def test_the_page_renders_the_live_model_plan_and_doctor_in_a_browser(appliance: RunningAppliance, tmp_path: Path):
    wait_for(lambda: loopback.get(f"{appliance.url}/readyz").status_code == 200, 120, what="ready")
    plan = loopback.get(f"{appliance.url}/v1/appliance/plan", timeout=30).json()
    status = loopback.get(f"{appliance.url}/v1/appliance/status", timeout=30).json()
    sessions = plan["sessions_at_context"][str(plan["targets"]["context"])]

    dom = _chromium("--dump-dom", f"{appliance.url}/", cwd=tmp_path).stdout
    assert re.search(rf'<span id="model">{re.escape(appliance.served_name)}</span>', dom), dom[:3000]
    assert re.search(r'<span class="badge ready" id="engine-state">ready</span>', dom), dom[:3000]
    assert f'<code id="digest">{status["model"]["digest"]}</code>' in dom
    assert re.search(rf'<td id="sessions">{sessions}\b', dom), dom
    assert f'{plan["kv"]["kv_tokens_reported"]:,} tokens' in dom
    findings = re.findall(r'<tr class="finding" data-check="([a-z-]+)">', dom)
    assert "engine-state" in findings and "kv-pressure" in findings, findings

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "status-page.png"
    shot.unlink(missing_ok=True)
    _chromium(f"--screenshot={shot}", "--window-size=1280,1600", "--hide-scrollbars", f"{appliance.url}/",
              cwd=tmp_path)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n", png[:16]
    assert struct.unpack(">II", png[16:24]) == (1280, 1600)
    print(f"status page screenshot: {shot}")

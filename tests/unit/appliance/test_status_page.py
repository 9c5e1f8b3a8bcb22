"""The status page (GET / and /status) and the figures the monitoring folder's rules read, against the
daemon assembled as in production (planned for the embedded default, its engine not started): what a
technician sees, who may see it, and that what it shows is shown as text."""

from __future__ import annotations

import asyncio
import base64
import re
from pathlib import Path

import httpx

from appliance.boot.assembly import build
from appliance.boot.config import load
from appliance.boot.planning import plan_for_config
from appliance.engine.supervisor import EngineState, EngineSupervisor
from appliance.runtime.daemon import Daemon
from appliance.store import keys
from kvbudget.gpu import Discovery
from tests.support import model_stand_in, write_config

HOSTILE = "<script>alert(1)</script>"


def _daemon(tmp_path: Path, require_keys: str = "auto") -> Daemon:
    path = write_config(tmp_path, model=model_stand_in(tmp_path),
                        extra=f'[site]\nname = "{HOSTILE}"\n[auth]\nrequire_keys = "{require_keys}"\n')
    cfg = load(path)
    site_plan = plan_for_config(cfg, Discovery(error="no NVIDIA driver"), ask_vllm=False)
    supervisor = EngineSupervisor(cfg, site_plan.plan.vllm_args)
    supervisor.status.state = EngineState.READY
    return build(cfg, site_plan, supervisor=supervisor)


def _get(daemon: Daemon, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=daemon.app), base_url="http://t") as c:
            return await c.get(path, headers=headers or {})

    return asyncio.run(go())


def _basic(secret: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"technician:{secret}".encode()).decode()}


def test_the_page_shows_the_model_the_plan_and_the_doctor_as_text(tmp_path: Path):
    daemon = _daemon(tmp_path)
    r = _get(daemon, "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), r.text[:300]
    page = r.text
    plan = daemon.state.site_plan.plan
    assert f'<span id="model">{daemon.state.cfg.served_name}</span>' in page
    sessions = plan.sessions_at[plan.engine.max_model_len]
    assert re.search(rf'<td id="sessions">{sessions}\b', page), page
    assert 'data-check="engine-state"' in page and 'data-check="speculative"' in page  # the doctor's findings
    assert HOSTILE not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # the site's name, as text
    assert "<script" not in page and "http://" not in page and "https://" not in page  # no script, nothing fetched
    assert _get(daemon, "/status").text.count('data-check="engine-state"') == 1


def test_where_keys_are_required_the_page_asks_a_browser_for_an_admin_key(tmp_path: Path):
    daemon = _daemon(tmp_path, require_keys="always")
    _, user = keys.create(daemon.state.cfg.database_path, "front desk")
    _, admin = keys.create(daemon.state.cfg.database_path, "technician", admin=True)
    asked = _get(daemon, "/")
    assert asked.status_code == 401 and asked.headers["www-authenticate"].startswith("Basic realm=")
    assert _get(daemon, "/v1/appliance/status").headers["www-authenticate"] == "Bearer"  # the API's routes: unchanged
    refused = _get(daemon, "/", _basic(user))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_scope_required"
    assert _get(daemon, "/", _basic("not-a-key")).status_code == 401
    assert _get(daemon, "/", {"Authorization": "Basic !!!"}).status_code == 401  # not base64: no key at all
    assert _get(daemon, "/", _basic(admin)).status_code == 200
    assert _get(daemon, "/status", {"Authorization": f"Bearer {admin}"}).status_code == 200
    # Basic credentials are a key like any other: an admin key given so also opens the API's admin routes
    assert _get(daemon, "/v1/appliance/plan", _basic(admin)).status_code == 200


def test_the_metrics_carry_what_the_alert_rules_read(tmp_path: Path):
    daemon = _daemon(tmp_path)
    text = _get(daemon, "/metrics").text
    assert 'appliance_doctor_finding{check="engine-state",status="ok"} 1.0' in text
    assert 'appliance_doctor_finding{check="engine-state",status="fail"} 0.0' in text
    free = float(re.search(r"^appliance_state_disk_free_bytes (\S+)$", text, re.M).group(1))
    assert free > 0
    targets = dict(re.findall(r'^appliance_admission_ttft_target_seconds\{class="(\w+)"\} (\S+)$', text, re.M))
    assert targets == {cls: str(float(c.ttft_target_s)) for cls, c in daemon.state.cfg.admission.classes.items()}


def test_the_page_names_a_quantized_checkpoints_scheme(tmp_path: Path):
    """The weights line reads the plan's own account of the checkpoint (kvbudget.render.plan_dict)."""
    from dataclasses import replace

    from appliance.ops.status_page import weights
    from kvbudget.render import plan_dict

    plan = _daemon(tmp_path).state.site_plan.plan
    assert weights(plan_dict(plan)).endswith(", unquantized")
    quantized = replace(plan, model=replace(plan.model, quantization="compressed-tensors",
                                            weight_format="compressed-tensors/int-quantized"))
    assert weights(plan_dict(quantized)).endswith(", compressed-tensors/int-quantized")

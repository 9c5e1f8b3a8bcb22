"""packaging/monitoring/: the alert rules pass promtool's own checks and fire (and stay quiet) as their
scenarios say; every metric they and the dashboard name is one the appliance registers; every alert
points at a doctor check and a section of the operations guide that exist. The same names are checked
against live appliances in tests/integration (test_admission_overload.py, test_cascade.py)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from appliance.ops.metrics import ENGINE_FAMILIES, Metrics
from tests.monitoring import (
    ALERTS,
    DASHBOARD,
    MONITORING,
    SCENARIOS,
    dashboard_queries,
    docs_anchor,
    exported_names,
    rules,
    used_names,
)
from tests.support import REPO, needs_tools


@needs_tools("promtool")
def test_promtool_checks_the_rules():
    r = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules())} rules found" in r.stdout, r.stdout


def _scenarios_with_annotations(folder: Path) -> Path:
    """alerts.scenarios.yml completed with each expected alert's annotations (promtool compares them),
    beside a copy of alerts.yml, as promtool resolves rule_files from the test file's folder."""
    by_name = rules()
    cases = yaml.safe_load(SCENARIOS.read_text())
    for case in cases["tests"]:
        for check in case["alert_rule_test"]:
            for alert in check["exp_alerts"]:
                alert["exp_annotations"] = by_name[check["alertname"]]["annotations"]
    (folder / "alerts.yml").write_text(ALERTS.read_text())
    out = folder / "alerts.scenarios.yml"
    out.write_text(yaml.safe_dump(cases))
    return out


@needs_tools("promtool")
def test_every_alert_fires_where_it_should_and_nowhere_else(tmp_path: Path):
    r = subprocess.run(["promtool", "test", "rules", str(_scenarios_with_annotations(tmp_path))],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    # A rule no scenario expects to fire could be one that never does.
    firing = {c["alertname"] for case in yaml.safe_load(SCENARIOS.read_text())["tests"]
              for c in case["alert_rule_test"] if c["exp_alerts"]}
    assert firing == set(rules()), set(rules()) ^ firing


def test_every_alert_names_a_doctor_check_and_a_runbook_section():
    doctor_source = (REPO / "appliance/ops/doctor.py").read_text() + (REPO / "appliance/cli/doctor.py").read_text()
    checks = set(re.findall(r'Finding\("([a-z-]+)"', doctor_source))
    ops = re.sub(r"^```.*?^```", "", (REPO / "docs/operations.md").read_text(), flags=re.M | re.S)  # not code
    anchors = {docs_anchor(h) for h in re.findall(r"^#+ (.+)$", ops, re.M)}
    for name, rule in rules().items():
        notes = rule["annotations"]
        assert notes["doctor"] in checks, (name, notes["doctor"], sorted(checks))
        path, _, anchor = notes["runbook"].partition("#")
        assert path == "docs/operations.md" and anchor == name.lower() and anchor in anchors, (name, notes["runbook"])
        assert rule["labels"]["severity"] in ("page", "ticket"), name


def _registered_names() -> set[str]:
    """What the appliance's registry declares, every optional part attached, and the engine's families."""
    metrics = Metrics()
    metrics.attach_cascade(lambda: {"requests": {}, "outbox": {"counts": {}, "oldest_age_s": 0.0}, "link": {}})
    metrics.attach_doctor(lambda: [])
    metrics.attach_state_dir(REPO)
    text = metrics.render().decode()
    # The engine's families as the engine names them; a counter's series end in _total (the exact names
    # are checked against the live engine in tests/integration).
    return exported_names(text) | ENGINE_FAMILIES | {f + "_total" for f in ENGINE_FAMILIES}


def test_every_metric_the_rules_and_the_dashboard_name_is_registered():
    assert used_names() - _registered_names() == set()


def test_the_dashboard_has_a_site_variable_and_every_panel_a_query():
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["site"]["multi"] and variables["site"]["includeAll"]  # one box, or the fleet
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            assert '$site' in t["expr"], (panel["title"], t["expr"])  # every query follows the site chosen
    assert len(dashboard_queries()) > 20


def test_the_monitoring_folder_holds_what_the_packages_ship():
    assert {p.name for p in MONITORING.iterdir()} == {"alerts.yml", "alerts.scenarios.yml", "dashboard.json",
                                                      "README.md"}

"""packaging/monitoring/ read the way Prometheus and Grafana read it: the alert rules, the dashboard's
queries, and the metric names they use, for the checks against the code and against a live appliance."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support import REPO

MONITORING = REPO / "packaging/monitoring"
ALERTS = MONITORING / "alerts.yml"
SCENARIOS = MONITORING / "alerts.scenarios.yml"
DASHBOARD = MONITORING / "dashboard.json"

# Prometheus's own series, not the appliance's.
PROMETHEUS_OWN = frozenset({"up"})
# Exported only where a regional cluster is configured: checked live against the cascade's appliance.
REGIONAL_PREFIXES = ("appliance_outbox_", "appliance_cascade_", "appliance_regional_", "appliance_escalation_budget_")

_PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                           "offset", "bool", "inf", "nan"})


def rules() -> dict[str, dict[str, Any]]:
    """Each alert's rule, by name."""
    return {r["alert"]: r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}


def dashboard_queries() -> list[str]:
    """Every PromQL expression the dashboard runs: its panels' targets and its template variables'."""
    dash = json.loads(DASHBOARD.read_text())
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", var["query"]["query"])
            assert m, var
            out.append(m.group(1))
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label matchers, ranges,
    grouping clauses, function calls and keywords are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        if m.group(2) is None and m.group(1).lower() not in _PROMQL_WORDS:
            names.add(m.group(1))
    return names


def used_names() -> set[str]:
    """Every metric name the alert rules and the dashboard select."""
    exprs = [r["expr"] for r in rules().values()] + dashboard_queries()
    return set().union(*(metric_names(e) for e in exprs)) - PROMETHEUS_OWN


def exported_names(metrics_text: str) -> set[str]:
    """The series names a /metrics text offers to a query: every sample's name, and for a family declared
    without samples yet (a labelled metric nobody has touched), the names its type gives it."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count"),
                "gauge": ("",), "info": ("_info",), "unknown": ("",)}
    names: set[str] = set()
    for family in text_string_to_metric_families(metrics_text):
        names |= {s.name for s in family.samples}
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


def missing_from(metrics_text: str, regional: bool) -> set[str]:
    """The names the rules and the dashboard use that this live /metrics does not export: of the regional
    families (`regional`) or of all the others."""
    wanted = {n for n in used_names() if n.startswith(REGIONAL_PREFIXES) == regional}
    return wanted - exported_names(metrics_text)


def docs_anchor(title: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")

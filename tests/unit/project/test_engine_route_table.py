"""docs/http-api.md's table of the engine's routes against the appliance's own app: every route it says is
served is one the app answers (the integration suite compares the table with the running engine's routes)."""

from __future__ import annotations

import re
from pathlib import Path

from appliance.api.app import create_app
from appliance.api.gateway import Gateway, GatewaySettings
from appliance.boot import config
from appliance.engine.supervisor import EngineSupervisor

DOC = Path(__file__).resolve().parents[3] / "docs" / "http-api.md"


def engine_route_table() -> dict[tuple[str, str], str]:
    """(method, path) -> "served" or "refused", from the table between the engine-routes markers."""
    text = DOC.read_text()
    table = text.split("<!-- engine-routes -->", 1)[1].split("<!-- /engine-routes -->", 1)[0]
    out: dict[tuple[str, str], str] = {}
    for cell, verdict in re.findall(r"^\| (`[^|]+`) \| (served|refused) \|", table, re.M):
        for method, path in re.findall(r"`(GET|POST|DELETE|PUT) ([^`]+)`", cell):
            out[(method, path)] = verdict
    return out


def test_every_route_the_table_says_is_served_is_answered_by_the_app(tmp_path):
    table = engine_route_table()
    assert len(table) >= 20 and ("POST", "/v1/responses") in table
    cfg = config.parse(f'[model]\npath = "{tmp_path}"\n[state]\ndirectory = "{tmp_path}/state"\n')
    app = create_app(Gateway(EngineSupervisor(cfg, []), GatewaySettings("m", 1 << 20, 3, 10.0), None))
    served = {(m, r.path) for r in app.routes for m in getattr(r, "methods", ()) or ()}
    missing = [f"{m} {p}" for (m, p), v in table.items() if v == "served" and (m, p) not in served]
    assert missing == [], f"docs/http-api.md says these are served, the app has no such route: {missing}"
    refused_but_routed = [f"{m} {p}" for (m, p), v in table.items() if v == "refused" and (m, p) in served]
    assert refused_but_routed == []

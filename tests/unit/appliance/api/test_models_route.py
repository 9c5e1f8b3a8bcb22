"""GET /v1/models/{id}: the SDKs' models.retrieve, answered by the appliance from the engine's own list
(vLLM serves only the list); an unknown id is OpenAI's 404, and the route is behind the key check."""

from __future__ import annotations

import httpx

from appliance.store import keys
from tests.unit.appliance.api.inprocess import call, serving

LISTED = {"object": "list", "data": [
    {"id": "m", "object": "model", "created": 1, "owned_by": "vllm", "max_model_len": 2048},
    {"id": "org/lora-a", "object": "model", "created": 1, "owned_by": "vllm", "parent": "m"},
]}


def _engine(request: httpx.Request) -> httpx.Response:
    assert request.method == "GET" and request.url.path == "/v1/models", request.url
    return httpx.Response(200, json=LISTED)


def test_each_listed_model_is_retrieved_as_listed(tmp_path):
    made = serving(tmp_path, _engine)
    try:
        for entry in LISTED["data"]:
            r = call(made.app, "GET", f"/v1/models/{entry['id']}")
            assert r.status_code == 200 and r.json() == entry
        r = call(made.app, "GET", "/v1/models/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["param"] == "model" and "'m'" in r.json()["error"]["message"]
    finally:
        made.log.close()


def test_retrieve_needs_a_key_where_keys_are_required(tmp_path):
    from tests.unit.appliance.api.inprocess import app

    cfg, application, log = app(tmp_path, required=True)
    try:
        assert call(application, "GET", "/v1/models/m").status_code == 401
        _, secret = keys.create(cfg.database_path, "app")
        assert call(application, "GET", "/v1/models/m", key=secret).status_code == 503  # past auth: no engine
    finally:
        log.close()

"""Issue 31's calls with keys required, on the real engine: the openai and anthropic SDKs with real keys
(Bearer, and x-api-key as the Anthropic SDK sends it) through the appliance, side by side with the engine
itself; each new route refuses a missing or revoked key in its API's shape; a bronze key's output limit
holds on a response and on a message."""

from __future__ import annotations

import json

import openai
import pytest

from appliance.boot import config
from appliance.engine.args import ENGINE_BASE_URL
from appliance.store import keys
from tests import loopback
from tests.support import launch_appliance, write_config

pytestmark = pytest.mark.engine

BRONZE_LIMIT = 6
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keyed")
    cfg_path = write_config(directory, extra=(
        '[auth]\nrequire_keys = "always"\n\n'
        f"[admission.classes.bronze]\nmax_tokens = {BRONZE_LIMIT}\nttft_target_s = 60\nqueue_limit = 64\n"))
    db = config.load(cfg_path).database_path
    silver = keys.create(db, "app")[1]
    bronze = keys.create(db, "batch", priority_class="bronze")[1]
    revoked_key, revoked = keys.create(db, "old")
    keys.revoke(db, revoked_key.id)
    app = launch_appliance(cfg_path, directory)
    try:
        app.wait_ready()
        yield app, silver, bronze, revoked
    finally:
        app.stop()


def _engine_key(app) -> str:
    return (config.load(app.config).state.directory / "engine.key").read_text().strip()


def test_the_sdks_with_keys_answer_as_the_engine_does(keyed):
    import anthropic

    app, silver, _, _ = keyed
    through = openai.OpenAI(base_url=f"{app.url}/v1", api_key=silver, max_retries=0, timeout=120,
                            http_client=loopback.client())
    straight = openai.OpenAI(base_url=f"{ENGINE_BASE_URL}/v1", api_key=_engine_key(app), max_retries=0, timeout=120,
                             http_client=loopback.unix_client(str(app.engine_socket)))
    seen = []
    for client in (through, straight):
        r = client.chat.completions.create(model=app.served_name, max_tokens=48, temperature=0, tools=[WEATHER],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           messages=[{"role": "user", "content": "Weather in Paris?"}])
        args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
        resp = client.responses.create(model=app.served_name, input="Name a colour.", max_output_tokens=8,
                                       temperature=0)
        seen.append((args, resp.output_text))
    assert seen[0] == seen[1] and isinstance(seen[0][0]["city"], str)
    anthropic_through = anthropic.Anthropic(base_url=app.url, api_key=silver, max_retries=0, timeout=120,
                                            http_client=loopback.anthropic_http_client())
    m = anthropic_through.messages.create(model=app.served_name, max_tokens=8, extra_body={"temperature": 0},
                                          messages=[{"role": "user", "content": "Name a colour."}])
    assert m.type == "message" and m.content[0].text.strip()


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/tokenize",
                                  "/v1/models/x"])
def test_each_new_route_refuses_a_missing_or_revoked_key_in_its_shape(keyed, path):
    app, _, _, revoked = keyed
    body = {"model": app.served_name, "input": "hi", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": f"Bearer {revoked}"}, {"x-api-key": revoked}):
        r = (loopback.get(f"{app.url}{path}", headers=headers, timeout=30) if path.startswith("/v1/models")
             else loopback.post(f"{app.url}{path}", json=body, headers=headers, timeout=30))
        assert r.status_code == 401, (path, headers, r.text)
        if path.startswith("/v1/messages"):
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
        else:
            assert r.json()["error"]["code"] in ("missing_api_key", "invalid_api_key")


def test_a_bronze_key_s_limit_holds_on_a_response_and_a_message(keyed):
    app, _, bronze, _ = keyed
    auth = {"Authorization": f"Bearer {bronze}"}
    r = loopback.post(f"{app.url}/v1/responses", headers=auth, timeout=120,
                      json={"model": app.served_name, "input": "Count to fifty."})
    assert r.status_code == 200 and 1 <= r.json()["usage"]["output_tokens"] <= BRONZE_LIMIT, r.text
    over = loopback.post(f"{app.url}/v1/messages", headers={"x-api-key": bronze}, timeout=60,
                         json={"model": app.served_name, "max_tokens": BRONZE_LIMIT + 1,
                               "messages": [{"role": "user", "content": "hi"}]})
    assert over.status_code == 400 and over.json()["type"] == "error"
    assert "bronze class limit" in over.json()["error"]["message"]

"""llm-d's gateway conventions (issue 14): the scheduling headers an escalation carries, and a gateway's
429/503 drop with Retry-After honoured by the breaker and the forwarder and shown on the escalation."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from email.utils import format_datetime
from pathlib import Path

import httpx
import pytest

from appliance.boot import config
from appliance.boot.escalation import regional_settings
from cascade.delivery import RetryPolicy
from cascade.forwarder import Forwarder
from cascade.gateway_headers import GatewayHeaders, check_fairness_template, retry_after_s
from cascade.outbox import Outbox
from cascade.regional import RegionalClient, RegionalFailed, RegionalSettings

GATEWAY = GatewayHeaders(objectives={"gold": "edge-gold", "bronze": "edge-bronze"}, site="clinic-7",
                         ttft_ms={"gold": 2000, "bronze": 15000}, tpot_ms={"gold": 50})


def test_each_class_and_tenant_gets_its_objective_fairness_id_and_targets():
    assert GATEWAY.for_request("gold", "radiology") == {
        "x-gateway-inference-objective": "edge-gold", "x-gateway-inference-fairness-id": "clinic-7/radiology",
        "x-slo-ttft-ms": "2000", "x-slo-tpot-ms": "50"}
    assert GATEWAY.for_request("bronze", None) == {
        "x-gateway-inference-objective": "edge-bronze", "x-gateway-inference-fairness-id": "clinic-7/default",
        "x-slo-ttft-ms": "15000"}
    odd = GatewayHeaders(objectives={}, fairness_id="{tenant}@{site}", site="Zürich west")
    assert odd.for_request("silver", "a b") == {"x-gateway-inference-fairness-id": "a%20b@Z%C3%BCrich%20west"}


def test_the_fairness_template_may_name_only_site_and_tenant():
    check_fairness_template("{site}-{tenant}")
    for bad in ("{key}", "{site", "{0}"):
        with pytest.raises(ValueError, match="only"):
            check_fairness_template(bad)


def test_the_configuration_turns_the_headers_on_with_the_class_targets(tmp_path: Path):
    base = (f'[model]\npath = "{tmp_path}"\n[state]\ndirectory = "{tmp_path}/s"\n[site]\nname = "store-12"\n'
            '[regional]\nenabled = true\nbase_url = "http://r/v1"\nmodel = "big"\n')
    assert regional_settings(config.parse(base)).gateway is None  # a plain OpenAI endpoint by default
    on = config.parse(base + 'llm_d_headers = true\ntpot_slo_ms = { gold = 40 }\n'
                             '[admission.classes.silver]\nttft_target_s = 4.5\n')
    headers = regional_settings(on).gateway.for_request("silver", "pharmacy")
    assert headers == {"x-gateway-inference-objective": "edge-silver",
                       "x-gateway-inference-fairness-id": "store-12/pharmacy", "x-slo-ttft-ms": "4500"}
    with pytest.raises(config.ConfigError, match="fairness_id"):
        config.parse(base + 'fairness_id = "{user}"\n')


def test_retry_after_in_seconds_or_as_a_date_and_capped():
    assert retry_after_s("7") == 7.0
    assert retry_after_s("99999", cap_s=300) == 300.0
    later = datetime.fromtimestamp(1_000_030, UTC)
    assert retry_after_s(format_datetime(later, usegmt=True), now=1_000_000) == 30.0
    assert retry_after_s("soon") is None and retry_after_s(None) is None and retry_after_s("-3") is None


def _client(answer: httpx.Response, seen: list[httpx.Request]) -> RegionalClient:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer

    settings = RegionalSettings(base_url="http://regional/v1", model="big", gateway=GATEWAY, breaker_max_reset_s=120)
    return RegionalClient(settings, transport=httpx.MockTransport(handler))


def test_a_drop_with_retry_after_holds_the_breaker_and_names_the_reason():
    seen: list[httpx.Request] = []
    client = _client(httpx.Response(503, headers={"x-llm-d-request-dropped-reason": "saturated", "retry-after": "30"},
                                     json={"error": {"message": "dropped"}}), seen)

    async def go() -> RegionalFailed:
        with pytest.raises(RegionalFailed) as e:
            await client.complete("/v1/chat/completions", {"model": "big"}, "esc-1", priority_class="gold",
                                  tenant="radiology")
        await client.aclose()
        return e.value

    err = asyncio.run(go())
    assert err.retry_after_s == 30.0 and "reason 'saturated'" in str(err) and "retry after 30s" in str(err)
    assert client.breaker.state == "open" and 29 < client.breaker.retry_in_s <= 30
    assert client.link_up is True  # the link works; the cluster is busy
    sent = seen[0].headers
    assert (sent["x-gateway-inference-objective"], sent["x-gateway-inference-fairness-id"], sent["idempotency-key"]) \
        == ("edge-gold", "clinic-7/radiology", "esc-1")


def test_a_drop_without_retry_after_is_an_ordinary_failure_with_its_reason():
    client = _client(httpx.Response(429, headers={"x-llm-d-request-dropped-reason": "fairness"}), [])

    async def go() -> RegionalFailed:
        with pytest.raises(RegionalFailed) as e:
            await client.complete("/v1/chat/completions", {"model": "big"}, "esc-2")
        await client.aclose()
        return e.value

    err = asyncio.run(go())
    assert err.retry_after_s is None and "(429, reason 'fairness')" in str(err)
    assert client.breaker.state == "closed"


def test_the_forwarder_waits_as_asked_without_spending_an_attempt(tmp_path: Path):
    now = [1000.0]
    box = Outbox(tmp_path / "o.db", clock=lambda: now[0])
    esc = box.put("/v1/chat/completions", {"model": "big", "messages": []}, priority_class="bronze", tenant="lab")
    seen: list[httpx.Request] = []
    client = _client(httpx.Response(503, headers={"x-llm-d-request-dropped-reason": "saturated",
                                                  "retry-after": "90"}), seen)
    fwd = Forwarder(box, client, retry=RetryPolicy(max_attempts=1, base_s=5))

    async def go() -> None:
        await fwd.step()
        await client.aclose()

    asyncio.run(go())
    row = box.get(esc.id)
    assert row is not None and row.status == "queued", row  # max_attempts=1: a counted attempt would fail it
    assert row.attempts == 0 and row.next_attempt >= now[0] + 90, row
    assert "reason 'saturated'" in (row.last_error or "")
    assert json.loads(seen[0].content) == {"model": "big", "messages": []}
    assert seen[0].headers["x-gateway-inference-objective"] == "edge-bronze"
    assert seen[0].headers["x-gateway-inference-fairness-id"] == "clinic-7/lab"

"""The fuzz suite (issue 15): Hypothesis-drawn hostile requests against the real appliance and engine.

A bounded budget here (FUZZ_REQUESTS, default 600; FUZZ_SEED repeats a run); `make fuzz` runs the long
one (bench/fuzz.py, 10,000). What every answer must be is in tests/fuzz/campaign.py.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.fuzz.campaign import Limits, daemon_tracebacks, run_campaign
from tests.support import start_appliance

pytestmark = pytest.mark.engine

LIMITS = Limits()


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    app = start_appliance(tmp_path_factory.mktemp("fuzzed"), server_extra=LIMITS.server_toml(),
                          extra=LIMITS.admission_toml())
    try:
        app.wait_ready()
        yield app
    finally:
        app.stop()


def test_hostile_requests_get_clean_answers_and_lose_no_rows(fuzzed):
    count = int(os.environ.get("FUZZ_REQUESTS", "600"))
    run_seed = int(os.environ.get("FUZZ_SEED", random.randrange(2**32)))
    report = run_campaign(fuzzed, count, run_seed, LIMITS)
    print(report.summary())
    assert len(report.outcomes) == count
    assert not report.problems, (f"{report.summary()}\n(rerun with FUZZ_SEED={run_seed})\n"
                                 + "\n".join(report.problems[:15]))


def test_broken_framing_and_stalled_clients_get_an_answer_in_time(fuzzed):
    """Raw sockets: every connection is answered, within the header and body deadlines, in HTTP a client can
    read, with an OpenAI error body and never a 500; then the appliance still serves."""
    import asyncio

    from tests import loopback
    from tests.fuzz.wire import draw_wire_probes, probe_all

    count = int(os.environ.get("FUZZ_WIRE_CONNECTIONS", "200"))
    run_seed = int(os.environ.get("FUZZ_SEED", random.randrange(2**32)))
    deadline = LIMITS.header_timeout_s + LIMITS.body_timeout_s + 20
    drawn = draw_wire_probes(count, run_seed)
    problems = asyncio.run(probe_all(fuzzed.port, drawn, concurrency=16, deadline_s=deadline))
    assert not problems, f"{len(problems)} of {count} connections (rerun with FUZZ_SEED={run_seed}):\n" + "\n".join(
        problems[:15])
    assert loopback.get(f"{fuzzed.url}/readyz", timeout=10).status_code == 200
    assert not daemon_tracebacks(fuzzed.log_text())


def test_the_class_limit_holds_on_the_responses_and_messages_routes(fuzzed):
    """The fuzzed appliance's callers are bronze, limited to LIMITS.max_tokens: on the real engine a response
    left without max_output_tokens stops within it, and asking for more is refused in each API's shape."""
    from tests import loopback

    url, model = fuzzed.url, fuzzed.served_name
    r = loopback.post(f"{url}/v1/responses", timeout=120, json={"model": model, "input": "Count to fifty."})
    assert r.status_code == 200 and 1 <= r.json()["usage"]["output_tokens"] <= LIMITS.max_tokens, r.text
    over = loopback.post(f"{url}/v1/responses", timeout=60,
                         json={"model": model, "input": "hi", "max_output_tokens": LIMITS.max_tokens + 1})
    assert over.status_code == 400 and over.json()["error"]["code"] == "max_tokens_over_class_limit"
    msg = {"model": model, "messages": [{"role": "user", "content": "Count to fifty."}]}
    ok = loopback.post(f"{url}/v1/messages", timeout=120, json={**msg, "max_tokens": LIMITS.max_tokens})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] <= LIMITS.max_tokens, ok.text
    refused = loopback.post(f"{url}/v1/messages", timeout=60, json={**msg, "max_tokens": LIMITS.max_tokens + 1})
    assert refused.status_code == 400 and refused.json()["type"] == "error"
    assert "bronze class limit" in refused.json()["error"]["message"]

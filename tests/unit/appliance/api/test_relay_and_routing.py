"""The gateway's rooms on their own: the SSE relay without a server, routing's refusals by their kind."""

from __future__ import annotations

import asyncio
import json

import pytest

from appliance.api.dialects import COMPLETIONS
from appliance.api.errors import ApiError
from appliance.api.exchange import Exchange, Exchanges
from appliance.api.relay import EventFilter, StreamJudge
from appliance.api.route_choice import Local, Refuse, Regional, choose_route
from cascade.policy import Decision


def _event(data: dict) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"  # as vLLM writes it


def _exchange(keep_text: bool = False) -> Exchange:
    ex = Exchanges(None, None, None).open("r1", COMPLETIONS, "silver", None)
    ex.rec.model, ex.rec.stream, ex.rec.status = "m", True, 200
    ex.rec.prompt = "hi" if keep_text else None
    return ex


def _run(chunks: list[bytes], strip_usage: bool, keep_text: bool = False, fail: bool = False,
         judge: StreamJudge | None = None):
    """The chunks through a stream's EventFilter as the splice feeds them: what the client gets, the record."""
    ex = _exchange(keep_text)
    rec = ex.rec
    events = EventFilter(ex, strip_usage, judge=judge)
    out = b"".join(events.feed(c) for c in chunks)
    out += events.broke_off(ConnectionError("engine gone")) if fail else asyncio.run(events.ending())
    events.finish()
    return out, rec


TEXT = _event({"choices": [{"index": 0, "text": "Par"}]}) + _event({"choices": [{"index": 0, "text": "is"}]})
USAGE = _event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
DONE = b"data: [DONE]\n\n"


def test_the_filter_takes_usage_and_strips_it_when_the_client_did_not_ask():
    # an event split across chunks is passed on whole, once complete
    out, rec = _run([TEXT[:10], TEXT[10:], USAGE, DONE], strip_usage=True, keep_text=True)
    assert out == TEXT + DONE
    assert (rec.prompt_tokens, rec.completion_tokens, rec.completion) == (5, 2, "Paris")
    assert rec.ttft_ms is not None


def test_the_filter_keeps_usage_for_a_client_that_asked():
    out, rec = _run([TEXT + USAGE + DONE], strip_usage=False)
    assert USAGE in out and rec.completion_tokens == 2


def test_a_broken_engine_stream_ends_with_an_error_event():
    out, rec = _run([TEXT], strip_usage=True, fail=True)
    last = json.loads(out.rsplit(b"data: ", 1)[1])
    assert last["error"]["code"] == "engine_stream_broken" and rec.status == 502


def test_a_judged_stream_s_end_waits_for_the_judge():
    """[DONE] is held back by the filter, whatever the chunking, and the end hook puts the judge's word
    before it; the log-probabilities the judge read are hidden from a client that did not ask."""
    heard: list[int] = []

    async def after(tl) -> bytes:
        heard.append(len(tl.logprobs))
        return b": judged\n\n"

    scored = _event({"choices": [{"index": 0, "text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [-0.5],
                                                                          "top_logprobs": [{"a": -0.5}]}}]})
    judge = StreamJudge(hide=True, after=after)
    whole = scored + USAGE + DONE
    pieces = [whole[:7], whole[7:len(scored) + 3], whole[len(scored) + 3:]]
    events_before_end: list[bytes] = []
    events = EventFilter(_exchange(), True, judge=judge)
    for piece in pieces:
        events_before_end.append(events.feed(piece))
    assert DONE not in b"".join(events_before_end) and heard == []
    end = asyncio.run(events.ending())
    assert end == b": judged\n\n" + DONE and heard == [1]
    assert b"token_logprobs" in scored and b"-0.5" not in b"".join(events_before_end)


@pytest.mark.parametrize(("refusal", "status", "code"), [
    ("no_regional_endpoint", 404, "model_not_found"),
    ("escalation_forbidden", 403, "escalation_forbidden"),
])
def test_a_refusal_s_kind_picks_the_status_not_its_wording(refusal, status, code):
    # the same words for both: only the typed refusal tells them apart
    decision = Decision("refuse", "async", "no regional endpoint is configured", False, refusal)
    way = _choose(decision, model="big")
    assert isinstance(way, Refuse)
    assert (way.error.status, way.error.code, way.error.param) == (status, code, "model")


def test_an_unknown_model_is_404():
    way = _choose(None, model="other")
    assert isinstance(way, Refuse) and (way.error.status, way.error.code) == (404, "model_not_found")


NOT_READY = ApiError(503, "the engine is loading the model; retry later", code="engine_not_ready")


def _choose(decision, *, model="local", regional_model=False, ready=True, link=True):
    return choose_route(decision, model=model, served_name="local", serves_regionally=regional_model,
                        engine_refusal=None if ready else NOT_READY, link_usable=link)


def _d(action, mode="async", may_escalate=True):
    return Decision(action, mode, "because", may_escalate)


@pytest.mark.parametrize(("decision", "kw", "expected"), [
    (None, {}, Local()),
    (_d("local"), {}, Local()),
    (_d("local_then_judge"), {}, Local(judge=True)),
    (_d("escalate_now"), {}, Local(queue_escalation=True)),
    (_d("escalate_now", "sync"), {}, Regional(fallback_local=True)),
    (_d("escalate_now", "sync"), {"ready": False}, Regional(fallback_local=False)),
    (_d("escalate_now", "sync"), {"model": "big", "regional_model": True}, Regional(fallback_local=False)),
    (_d("escalate_now"), {"model": "big", "regional_model": True}, Regional(fallback_local=False)),
    # the engine down: the regional cluster answers where the policy and the link allow, else the 503
    (_d("local"), {"ready": False}, Regional(fallback_local=False)),
    (_d("local", may_escalate=False), {"ready": False}, Refuse(NOT_READY)),
    (_d("local"), {"ready": False, "link": False}, Refuse(NOT_READY)),
    (None, {"ready": False}, Refuse(NOT_READY)),
])
def test_each_request_has_one_way(decision, kw, expected):
    assert _choose(decision, **kw) == expected

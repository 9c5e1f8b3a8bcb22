"""The fuzz campaign's check of a 200 stream reads SSE's lines as SSE defines them (\\n-terminated): a fresh
run once found a Responses stream "not ending with response.completed" that did end with it, because the
answer echoed a \\x1c from the request's instructions and splitlines() cut the last data line there."""

from __future__ import annotations

from tests.fuzz.campaign import Outcome, _answer_problem
from tests.fuzz.requests import Probe

DONE = b'event: response.completed\ndata: {"response":{"instructions":"a\\x1cb \xe2\x80\xa8"},"type":"response.completed"}\n\n'


def _stream(path: str, body: bytes) -> Outcome:
    probe = Probe("POST", path, (), b"{}", False)
    return Outcome(probe, "x", 200, {"content-type": "text/event-stream"}, body)


def test_a_stream_that_ends_with_its_final_event_passes_whatever_the_text_echoes():
    body = b'event: response.created\ndata: {"type":"response.created"}\n\n' + DONE.replace(b"\\x1c", b"\x1c")
    assert _answer_problem(_stream("/v1/responses", body)) is None


def test_a_stream_cut_before_its_final_event_is_a_problem():
    body = b'event: response.created\ndata: {"type":"response.created"}\n\n'
    assert "did not end with response.completed" in (_answer_problem(_stream("/v1/responses", body)) or "")
    chat = b'data: {"choices":[{"delta":{"content":"\x1c"}}]}\n\n'
    assert "did not end with [DONE]" in (_answer_problem(_stream("/v1/chat/completions", chat)) or "")

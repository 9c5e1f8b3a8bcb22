"""The P/D stand-in's sidecar (tests/pd_cluster.py) follows llm-d's flow, checked against two recording
servers in place of vLLM: the cascade tests and bench/outbox.py rely on it (the transfer itself is checked
against real vLLM in tests/integration/test_cascade.py)."""

from __future__ import annotations

import json

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests import loopback
from tests.pd_cluster import PDSidecar
from tests.support import free_port, serve_in_thread

SSE = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'


class Pod:
    """A stand-in model server that records what it was sent."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.got: list[dict] = []

        async def complete(request: Request) -> Response:
            body = await request.json()
            self.got.append(body)
            if body.get("stream"):
                return Response(SSE, media_type="text/event-stream")
            return JSONResponse({"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": 300}},
                                status_code=self.status)

        self.server = serve_in_thread(Starlette(routes=[Route("/v1/chat/completions", complete, methods=["POST"])]))
        self.port = self.server.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture()
def pods():
    prefill, decode = Pod(), Pod()
    sidecar = PDSidecar(prefill.url, decode.url)
    yield prefill, decode, sidecar
    sidecar.close()
    prefill.server.stop()
    decode.server.stop()


REQUEST = {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 9, "min_tokens": 2,
           "stream": True, "stream_options": {"include_usage": True}, "n": 1}


def test_prefill_gets_one_token_unstreamed_then_decode_gets_the_whole_request(pods):
    prefill, decode, sidecar = pods
    with loopback.stream("POST", f"{sidecar.url}/v1/chat/completions", json=REQUEST, timeout=10) as r:
        assert r.status_code == 200 and b"".join(r.iter_raw()) == SSE
    [p] = prefill.got
    assert p["max_tokens"] == 1 and p["stream"] is False and p["kv_transfer_params"]["do_remote_decode"] is True
    assert not {"min_tokens", "stream_options", "n"} & p.keys() and p["messages"] == REQUEST["messages"]
    assert decode.got == [REQUEST]  # ExampleConnector answers no transfer parameters: nothing added
    assert [h.side for h in sidecar.hops] == ["prefill", "decode"]


def test_a_non_streamed_answer_records_its_prompt_tokens(pods):
    _, _, sidecar = pods
    r = loopback.post(f"{sidecar.url}/v1/chat/completions", json=dict(REQUEST, stream=False), timeout=10)
    assert r.status_code == 200 and sidecar.sent("decode")[0].prompt_tokens == 300


def test_a_prefill_refusal_is_the_answer_and_decode_is_not_asked(pods):
    prefill, decode, sidecar = pods
    prefill.status = 400
    r = loopback.post(f"{sidecar.url}/v1/chat/completions", json=REQUEST, timeout=10)
    assert r.status_code == 400 and decode.got == []


def test_a_server_that_is_down_is_a_502_with_an_openai_body():
    sidecar = PDSidecar(f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}")
    try:
        r = loopback.post(f"{sidecar.url}/v1/chat/completions", json=REQUEST, timeout=10)
    finally:
        sidecar.close()
    assert r.status_code == 502 and "ConnectError" in r.json()["error"]["message"]


def test_skipping_prefill_sends_decode_alone(pods):
    prefill, decode, sidecar = pods
    sidecar.skip_prefill = True
    loopback.post(f"{sidecar.url}/v1/chat/completions", json=dict(REQUEST, stream=False), timeout=10)
    assert prefill.got == [] and len(decode.got) == 1
    assert json.dumps(decode.got[0]) == json.dumps(dict(REQUEST, stream=False))

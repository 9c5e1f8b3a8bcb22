"""The regional client over TLS for real: a server on loopback with a throwaway CA (trustme) that requires
a client certificate, as a regional cluster's gateway with mutual TLS does."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
import trustme
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from appliance.boot.config import load
from appliance.boot.startup import runtime_problems
from cascade.regional import LinkDown, RegionalClient, RegionalSettings, TLSFileError, tls_verify
from tests.support import serve_in_thread

ANSWER = {"id": "x", "object": "chat.completion", "model": "regional",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}


class TLSServer:
    def __init__(self, d: Path, ca: trustme.CA) -> None:
        server_cert = ca.issue_cert("127.0.0.1", "localhost")
        server_cert.private_key_and_cert_chain_pem.write_to_path(str(d / "server.pem"))
        ca.cert_pem.write_to_path(str(d / "client-ca.pem"))  # the same CA signs the clients it accepts
        self.seen: list[str] = []

        async def complete(request: Request) -> JSONResponse:
            self.seen.append(request.headers.get("idempotency-key", ""))
            return JSONResponse(ANSWER)

        app = Starlette(routes=[Route("/v1/chat/completions", complete, methods=["POST"])])
        self.server = serve_in_thread(app, log_level="error", ssl_certfile=str(d / "server.pem"),
                                      ssl_ca_certs=str(d / "client-ca.pem"), ssl_cert_reqs=ssl.CERT_REQUIRED)
        self.port = self.server.port

    def close(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    client = ca.issue_cert("edge-site-042.example")
    client.cert_chain_pems[0].write_to_path(str(d / "client.pem"))
    client.private_key_pem.write_to_path(str(d / "client.key"))
    server = TLSServer(d, ca)
    yield d, server
    server.close()


def settings(d: Path, port: int, **kw) -> RegionalSettings:
    return RegionalSettings(base_url=f"https://127.0.0.1:{port}/v1", model="regional", connect_timeout_s=2,
                            read_timeout_s=5, retries=0, **kw)


def call(s: RegionalSettings, key: str):
    async def go():
        client = RegionalClient(s)
        try:
            return await client.complete("/v1/chat/completions", {"model": "regional", "messages": []}, key)
        finally:
            await client.aclose()
    return asyncio.run(go())


def test_ca_bundle_and_client_certificate_reach_a_mutual_tls_server(pki):
    d, server = pki
    answer = call(settings(d, server.port, ca_bundle=d / "ca.pem", client_cert=d / "client.pem",
                           client_key=d / "client.key"), "esc-tls-1")
    assert answer.status == 200 and answer.body["model"] == "regional" and "esc-tls-1" in server.seen


def test_without_the_client_certificate_the_server_refuses_the_handshake(pki):
    d, server = pki
    with pytest.raises(LinkDown):
        call(settings(d, server.port, ca_bundle=d / "ca.pem"), "esc-tls-2")
    assert "esc-tls-2" not in server.seen


def test_without_the_ca_bundle_the_server_is_not_trusted(pki):
    d, server = pki
    with pytest.raises(LinkDown):
        call(settings(d, server.port, client_cert=d / "client.pem", client_key=d / "client.key"), "esc-tls-3")
    assert "esc-tls-3" not in server.seen


def test_no_tls_settings_leave_httpx_its_default_and_bad_files_are_named(tmp_path, pki):
    d, _ = pki
    assert tls_verify(settings(d, 1)) is True
    with pytest.raises(TLSFileError, match=r"regional\.ca_bundle .*missing\.pem"):
        tls_verify(settings(d, 1, ca_bundle=tmp_path / "missing.pem"))
    with pytest.raises(TLSFileError, match=r"regional\.client_cert"):
        tls_verify(settings(d, 1, ca_bundle=d / "ca.pem", client_cert=d / "ca.pem"))  # a cert without its key


def test_config_check_names_an_unreadable_ca_bundle(tmp_path):
    cfg = tmp_path / "appliance.toml"
    cfg.write_text(f"""
[model]
path = "{tmp_path}"
[state]
directory = "{tmp_path / 'state'}"
[engine]
kv_cache_memory_bytes = "1GiB"
[regional]
enabled = true
base_url = "https://regional.example/v1"
model = "regional"
ca_bundle = "{tmp_path / 'nope.pem'}"
""")
    problems = [str(p) for p in runtime_problems(load(cfg))]
    assert any("regional.ca_bundle" in p and "nope.pem" in p for p in problems), problems

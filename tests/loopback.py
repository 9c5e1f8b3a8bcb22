"""The tests' HTTP calls to the appliance and the engines on 127.0.0.1: httpx's, with one TLS context.

Why not loopback.get() and friends as they come: every httpx client builds its own TLS context and parses
the whole CA bundle into it (OpenSSL 3: tens of ms of CPU), even for a plain-HTTP URL that never uses
it. In CI a test thread once sat over 60 s inside that parse (`ssl.load_verify_locations`, under
`httpx.Client.__init__`) while the engine held both cores, and the request it was about to send never
left. Here the context is built once, at import, and every client gets it: a client then costs no
OpenSSL work at all. tests/unit/project/test_tests_use_loopback.py keeps the tests on these.
"""

from __future__ import annotations

import ssl
from typing import Any

import httpx

# Never used for a handshake (the tests speak plain HTTP); a default context, so a test that did meet
# TLS would verify it rather than silently trust it.
CONTEXT = ssl.create_default_context()


def get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(url, verify=CONTEXT, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(url, verify=CONTEXT, **kwargs)


def delete(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.delete(url, verify=CONTEXT, **kwargs)


def stream(method: str, url: str, **kwargs: Any):
    """httpx.stream: a context manager giving the response, its body not yet read."""
    return httpx.stream(method, url, verify=CONTEXT, **kwargs)


def client(**kwargs: Any) -> httpx.Client:
    return httpx.Client(verify=CONTEXT, **kwargs)


def async_client(**kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=CONTEXT, **kwargs)


def unix_client(path: str, **kwargs: Any) -> httpx.Client:
    """A client for a server on a Unix socket (the engine's): its transport gets the one context too."""
    return httpx.Client(transport=httpx.HTTPTransport(uds=path, verify=CONTEXT), verify=CONTEXT, **kwargs)


def anthropic_http_client(uds: str | None = None) -> Any:
    """The http_client for the anthropic package, which (from 2.x) runs on httpx2, httpx's fork, and
    refuses an httpx client: the same one TLS context, over a Unix socket when `uds` is given."""
    import httpx2

    transport = httpx2.HTTPTransport(uds=uds, verify=CONTEXT) if uds else None
    return httpx2.Client(transport=transport, verify=CONTEXT)

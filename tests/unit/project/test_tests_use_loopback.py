"""The tests make their HTTP calls through tests/loopback.py, which builds no TLS context per client.

A plain httpx.get() parses the CA bundle on every call; in CI one such parse stalled a test thread for
over a minute (see tests/loopback.py). This keeps a new test from bringing that back.
"""

from __future__ import annotations

import ast

from tests.support import REPO

TESTS = REPO / "tests"
MAKES_A_CONTEXT = {"get", "post", "put", "patch", "delete", "head", "options", "request", "stream",
                   "Client", "AsyncClient", "HTTPTransport", "AsyncHTTPTransport"}


def _offences(source: str) -> list[str]:
    """Calls that would build a TLS context: httpx's module functions and clients without a transport or
    a verify, and an OpenAI client without its own http_client."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)):
            continue
        module, name = node.func.value.id, node.func.attr
        given = {k.arg for k in node.keywords}
        if module == "httpx" and name in MAKES_A_CONTEXT and not given & {"transport", "verify"}:
            found.append(f"line {node.lineno}: httpx.{name}(...)")
        if module == "openai" and name in {"OpenAI", "AsyncOpenAI"} and "http_client" not in given:
            found.append(f"line {node.lineno}: openai.{name}(...) without http_client")
    return found


def test_the_check_finds_what_it_looks_for():
    bad = ("import httpx, openai\nhttpx.get('http://x')\nhttpx.Client()\n"
           "openai.OpenAI(base_url='http://x')\n")
    assert _offences(bad) == ["line 2: httpx.get(...)", "line 3: httpx.Client(...)",
                              "line 4: openai.OpenAI(...) without http_client"]
    good = ("import httpx\nhttpx.AsyncClient(transport=httpx.MockTransport(None))\n"
            "httpx.get('http://x', verify=CONTEXT)\nhttpx.HTTPError\n")
    assert _offences(good) == []


def test_no_test_builds_a_tls_context_per_call():
    offences = {}
    for path in sorted(TESTS.rglob("*.py")):
        found = _offences(path.read_text())
        if found and path.name != "loopback.py":
            offences[str(path.relative_to(TESTS))] = found
    assert not offences, f"use tests/loopback.py (get, post, stream, client, ...) instead: {offences}"

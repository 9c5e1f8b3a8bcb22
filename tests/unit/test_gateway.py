"""Gateway behaviour that needs no engine: the real app in-process."""

from __future__ import annotations

import asyncio

import httpx

from tests.unit.inprocess import app

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_request_ids_from_clients_are_kept_only_when_plain(tmp_path):
    cfg, application, log = app(tmp_path, required=False)
    try:
        async def go(rid: str) -> str:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://t") as c:
                r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": rid})
                return r.headers["x-request-id"]

        assert asyncio.run(go("order-42.a:b")) == "order-42.a:b"
        replaced = asyncio.run(go("x" * 500))
        assert replaced.startswith("req-") and len(replaced) < 64
        assert asyncio.run(go("bad id\twith tab")).startswith("req-")
    finally:
        log.close()

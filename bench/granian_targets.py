"""bench/gateway_floor.py --granian: its least relay and the appliance's app as granian ASGI targets, to
see whether a Rust HTTP server in place of uvicorn lowers what a stream costs (issue 13).

    granian --interface asgi bench.granian_targets:relay
    granian --interface asgi --factory bench.granian_targets:appliance

The engine's socket and the appliance's scratch folder come from the environment (ENGINE_SOCKET,
APPLIANCE_TMP), since granian imports the target in its own worker process.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import aiohttp

from appliance.engine.args import ENGINE_BASE_URL
from tests.support import asgi_body

_session: list[aiohttp.ClientSession] = []


async def relay(scope: dict, receive, send) -> None:
    """The same least relay as gateway_floor.least_relay, on whatever server imports it."""
    if scope["type"] != "http":
        return
    body = await asgi_body(receive)
    if not _session:
        _session.append(aiohttp.ClientSession(connector=aiohttp.UnixConnector(os.environ["ENGINE_SOCKET"])))
    async with _session[0].post(f"{ENGINE_BASE_URL}{scope['path']}", data=body,
                                headers={"content-type": "application/json"}) as r:
        await send({"type": "http.response.start", "status": r.status,
                    "headers": [(b"content-type", b"text/event-stream")]})
        async for chunk in r.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def appliance():
    """The daemon's app as gateway_floor.appliance_gateway builds it (its engine marked ready)."""
    from appliance import config
    from appliance.assembly import build
    from appliance.engine.supervisor import EngineState
    from appliance.planning import plan_for_config
    from bench.gateway_overhead import default_config

    cfg = config.load(str(default_config(Path(os.environ["APPLIANCE_TMP"]))))
    daemon = build(cfg, plan_for_config(cfg, ask_vllm=False))
    daemon.supervisor.status.state = EngineState.READY
    daemon.supervisor.launch = SimpleNamespace(base_url=ENGINE_BASE_URL)  # type: ignore[assignment]
    cfg.state.directory.mkdir(parents=True, exist_ok=True)
    daemon.request_log.start()
    return daemon.app

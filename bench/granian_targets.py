"""bench/gateway_floor.py --granian: its least relay and the appliance's app as granian ASGI targets, to
see whether a Rust HTTP server in place of uvicorn lowers what a stream costs (issue 13).

    granian --interface asgi --factory bench.granian_targets:relay
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


def relay_app(engine_socket: str):
    """The least a Python relay can do: the request's body to the engine, its answer's chunks back as they
    come, nothing else (gateway_floor.py serves it on uvicorn, this module on granian)."""
    session: list[aiohttp.ClientSession] = []

    async def app(scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = await asgi_body(receive)
        if not session:
            session.append(aiohttp.ClientSession(connector=aiohttp.UnixConnector(engine_socket)))
        async with session[0].post(f"{ENGINE_BASE_URL}{scope['path']}", data=body,
                                   headers={"content-type": "application/json"}) as r:
            await send({"type": "http.response.start", "status": r.status,
                        "headers": [(b"content-type", b"text/event-stream")]})
            async for chunk in r.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def relay():
    """granian --factory target: relay_app on the socket ENGINE_SOCKET names."""
    return relay_app(os.environ["ENGINE_SOCKET"])


def appliance():
    """The daemon's app as gateway_floor.appliance_gateway builds it (its engine marked ready)."""
    from appliance.boot import config
    from appliance.boot.assembly import build
    from appliance.boot.planning import plan_for_config
    from appliance.engine.supervisor import EngineState
    from bench.gateway_overhead import default_config

    cfg = config.load(str(default_config(Path(os.environ["APPLIANCE_TMP"]))))
    daemon = build(cfg, plan_for_config(cfg, ask_vllm=False))
    daemon.supervisor.status.state = EngineState.READY
    daemon.supervisor.launch = SimpleNamespace(base_url=ENGINE_BASE_URL)  # type: ignore[assignment]
    cfg.state.directory.mkdir(parents=True, exist_ok=True)
    daemon.request_log.start()
    return daemon.app

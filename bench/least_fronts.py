"""The least a Python front can be, each served in a process of its own: what bench/gateway_floor.py
(against a stand-in engine) and bench/gateway_overhead.py (against the real one) measure the appliance's
gateway against.

  least_relay   a raw ASGI app on uvicorn reading the engine over aiohttp: the floor of a Python front that
                passes every chunk through an HTTP client and ASGI's send
  least_splice  the least relay the appliance's way (appliance.api.splice): EngineStream for the engine
                leg, each chunk written by the connection layer's ClientWriter, on the daemon's uvicorn
                setup; no keys, admission, request log, metrics or filtering
"""

from __future__ import annotations

import socket
from pathlib import Path

from bench.granian_targets import relay_app
from tests.support import asgi_body, wait_for


def least_relay(port: int, engine_socket: str) -> None:
    import uvicorn
    import uvloop

    server = uvicorn.Server(uvicorn.Config(relay_app(engine_socket), host="127.0.0.1", port=port, log_config=None,
                                           access_log=False, lifespan="off"))
    uvloop.run(server.serve())


def least_splice(port: int, engine_socket: str) -> None:
    """The least relay the appliance's way (appliance.api.splice): the engine leg is EngineStream, each
    chunk written by the ClientWriter the daemon's connection layer puts in the scope; nothing else."""
    import uvicorn
    import uvloop

    from appliance.api.engine_stream import EngineStream
    from appliance.api.http_protocol import CLIENT_WRITER
    from appliance.boot import config
    from appliance.runtime.daemon import server_config

    async def app(scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = await asgi_body(receive)
        headers = {"Content-Type": "application/json"}
        auth = dict(scope["headers"]).get(b"authorization")
        if auth:  # the real engine's key (gateway_overhead.py's floor path); the stand-in asks for none
            headers["Authorization"] = auth.decode("latin-1")
        up = await EngineStream.open(Path(engine_socket), scope["path"], body, headers, connect_s=5, idle_s=60)
        await send({"type": "http.response.start", "status": up.status_code,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await up.splice(scope["extensions"][CLIENT_WRITER].write)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    server = config.ServerSection(host="127.0.0.1", port=port)
    uvloop.run(uvicorn.Server(server_config(app, server)).serve())


def accepts(port: int) -> bool:
    """Whether something accepts a connection on 127.0.0.1:port now."""
    try:
        with socket.create_connection(("127.0.0.1", port), 0.2):
            return True
    except OSError:
        return False


def wait_listening(port: int, timeout_s: float = 60) -> None:
    try:
        wait_for(lambda: accepts(port), timeout_s, 0.1, what=f"a listener on port {port}")
    except AssertionError:
        raise SystemExit(f"nothing listens on port {port}") from None

"""What reading an engine's SSE answer costs the gateway's engine leg: httpx, aiohttp and the appliance's
own EngineStream (read chunk by chunk as an Upstream, and spliced, each chunk to a plain function) side by
side, against one local aiohttp server (in a child process) that streams 64 vLLM-shaped events per request.

    python bench/upstream_clients.py [--requests 300] [--concurrency 8] [--rounds 2]

Prints the CPU of this process (the client) per request for each, rounds interleaved, and the ratios to
the spliced EngineStream: the reason the gateway reaches the engine with neither library.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from appliance.api.engine_stream import EngineStream
from bench.stand_in import serve_sse

EVENT = (b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
         b'"text":" the","logprobs":null,"finish_reason":null}]}\n\n')
EVENTS = 64


def serve(path: str) -> None:
    serve_sse(path, "/v1/completions", EVENT, EVENTS, 0.001)


async def measure(args: argparse.Namespace, path: str) -> None:
    # Over a Unix socket, the way the gateway reaches the engine.
    url = "http://engine/v1/completions"
    body, headers = b'{"model":"m","prompt":"hi","stream":true}', {"content-type": "application/json"}
    hc = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path))
    ac = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path))

    async def via_httpx() -> None:
        async with hc.stream("POST", url, content=body, headers=headers) as r:
            async for _ in r.aiter_raw():
                pass

    async def via_aiohttp() -> None:
        async with ac.post(url, data=body, headers=headers) as r:
            async for _ in r.content.iter_any():
                pass

    async def via_engine_stream() -> None:  # as judged streams and whole answers read it
        r = await EngineStream.open(Path(path), "/v1/completions", body, headers, connect_s=5, idle_s=60)
        async for _ in r.aiter_raw():
            pass

    async def spliced() -> None:  # as local streams are relayed (appliance.api.splice)
        r = await EngineStream.open(Path(path), "/v1/completions", body, headers, connect_s=5, idle_s=60)
        await r.splice(lambda chunk: None)

    clients: dict[str, Callable[[], Awaitable[None]]] = {
        "httpx": via_httpx, "aiohttp": via_aiohttp, "engine_stream": via_engine_stream, "spliced": spliced}
    cpu = {name: 0.0 for name in clients}
    for rnd in range(args.rounds):
        for name in (list(clients) if rnd % 2 == 0 else list(reversed(clients))):
            one = clients[name]
            for _ in range(5):  # warm: connections open, code paths hot
                await one()
            sem = asyncio.Semaphore(args.concurrency)

            async def guarded(one: Callable[[], Awaitable[None]] = one, sem: asyncio.Semaphore = sem) -> None:
                async with sem:
                    await one()

            c0 = time.process_time()
            await asyncio.gather(*(guarded() for _ in range(args.requests)))
            cpu[name] += time.process_time() - c0
    await hc.aclose()
    await ac.close()
    per = {name: 1e3 * c / (args.requests * args.rounds) for name, c in cpu.items()}
    for name, ms in per.items():
        print(f"{name:>13}: {ms:.2f} ms client CPU per {EVENTS}-event stream, {ms / per['spliced']:.2f}x spliced")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    path = str(Path(tempfile.mkdtemp(prefix="bench-upstream-")) / "engine.sock")
    server = multiprocessing.Process(target=serve, args=(path,), daemon=True)
    server.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("the stand-in server did not start") from None
                time.sleep(0.1)
        asyncio.run(measure(args, path))
    finally:
        server.terminate()


if __name__ == "__main__":
    main()

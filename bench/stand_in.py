"""A stand-in for the engine's streaming answer, for benchmarks that measure what sits in front of it:
an aiohttp server on a Unix socket (run it in a child process) answering POSTs to `route` with `events` copies of `event`
`gap_s` apart, then `tail`. Never used where the engine's behaviour is what a test checks."""

from __future__ import annotations

import asyncio

from aiohttp import web


def serve_sse(path: str, route: str, event: bytes, events: int, gap_s: float, tail: bytes = b"data: [DONE]\n\n") -> None:
    async def answer(req: web.Request) -> web.StreamResponse:
        await req.read()
        r = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await r.prepare(req)
        for _ in range(events):
            await r.write(event)
            await asyncio.sleep(gap_s)  # an engine step apart, so each event is its own read
        await r.write(tail)
        await r.write_eof()
        return r

    app = web.Application()
    app.router.add_post(route, answer)
    web.run_app(app, path=path, print=None)  # a Unix socket, as the real engine listens on

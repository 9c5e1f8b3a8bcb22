"""Does the gateway's memory level off? The appliance's own app in-process, its engine a stand-in that
answers at once, fed the fuzz suite's requests far past what a real engine on this machine gets through.

    python bench/gateway_memory.py [--requests 60000] [--seed N]

The long fuzz run (bench/fuzz.py) ends at 10,000 requests, still climbing about 0.2 MiB per 1,000. This
runs the same kind of traffic through the same gateway, request log and SQLite database six times as far,
without the engine, and prints the process's RSS after each tenth: flat after a rise means a bounded
cache (SQLite's pages, the key cache), a steady slope to the end means a leak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.fuzz.campaign import Limits, draw_probes
from tests.unit.appliance.api.inprocess import serving

ANSWER = {"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant",
          "content": "ok"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}


EVENTS = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
          b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\ndata: [DONE]\n\n')


def engine(request: httpx.Request) -> httpx.Response:
    if request.method == "GET":
        return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})
    if not json.loads(request.content).get("stream"):
        return httpx.Response(200, json=ANSWER)

    async def events():  # streamed, as the engine's answer is (a bytes body would be read already)
        yield EVENTS

    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())


async def run(app, probes, samples: int) -> list[tuple[int, float]]:
    me = psutil.Process()
    out = []
    step = max(1, len(probes) // samples)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://appliance") as c:
        for i, p in enumerate(probes, 1):
            headers = [(k.encode(), v.encode("utf-8", "surrogatepass")) for k, v in p.headers]
            await c.request(p.method, p.path, content=p.body or None, headers=headers)
            if i % step == 0:
                await asyncio.sleep(0.5)  # the request log's writer catches up
                out.append((i, me.memory_info().rss / 2**20))
    return out


def main(args: argparse.Namespace) -> None:
    limits = Limits()
    t = time.monotonic()
    distinct = draw_probes(min(args.requests, 5000), args.seed, "m", limits.max_tokens, limits.max_choices,
                           limits.max_body_bytes)
    probes = [distinct[i % len(distinct)] for i in range(args.requests)]
    print(f"{len(distinct)} distinct probes drawn in {time.monotonic() - t:.0f}s, sent {args.requests} times in all")
    made = serving(Path(tempfile.mkdtemp(prefix="bench-memory-")), engine)
    t = time.monotonic()
    series = asyncio.run(run(made.app, probes, 10))
    made.log.close()
    print(f"{args.requests} requests in {time.monotonic() - t:.0f}s")
    print("RSS MiB by requests: " + ", ".join(f"{n}: {m:.1f}" for n, m in series))
    half = len(series) // 2
    print(f"first half {series[half - 1][1] - series[0][1]:+.1f} MiB, second half "
          f"{series[-1][1] - series[half - 1][1]:+.1f} MiB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60_000)
    parser.add_argument("--seed", type=int, default=random.randrange(2**32))
    main(parser.parse_args())

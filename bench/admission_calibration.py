"""Does admission refuse only what would really miss its target? Its predictions against what happened.

    python bench/admission_calibration.py [--streams 32] [--per-stream 3] [--max-tokens 64]

A real appliance (real CPU engine, 16 slots as `make run` plans them) with `admission.refuse_late = false`:
admission predicts every request's time to first token as usual but refuses none for lateness, and each
answer carries the prediction (X-Appliance-Predicted-TTFT-Ms). `--streams` clients without keys (silver,
target 5 s) each send `--per-stream` streamed greedy chats back to back; the client times each first token.
Prints, against the silver target: how many admission would have refused, how many of those did miss it
(were right to refuse), how many it would have let through that missed, and the prediction's error.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from appliance.api.gateway import PREDICTED_TTFT
from tests.support import start_appliance

TARGET_S = 5.0  # silver's default ttft_target_s: the class of a request without a key


async def one_stream(session: aiohttp.ClientSession, url: str, model: str, n: int, max_tokens: int,
                     out: list[tuple[float, float]]) -> None:
    for i in range(n):
        body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"Write a short story about a lighthouse, part {i}."}]}
        t0 = time.perf_counter()
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                raise SystemExit(f"{r.status}: {await r.text()}")
            predicted = int(r.headers[PREDICTED_TTFT]) / 1000
            first = None
            async for line in r.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter() - t0
            out.append((predicted, first if first is not None else float("inf")))


async def run(url: str, model: str, args: argparse.Namespace) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await one_stream(s, url, model, 2, args.max_tokens, [])  # warm the engine
        await asyncio.gather(*(one_stream(s, url, model, args.per_stream, args.max_tokens, out)
                               for _ in range(args.streams)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--per-stream", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    app = start_appliance(Path(tempfile.mkdtemp(prefix="bench-calib-")), extra="[admission]\nrefuse_late = false\n")
    try:
        app.wait_ready()
        got = asyncio.run(run(app.url, app.served_name, args))
    finally:
        app.stop()
    refused = [(p, a) for p, a in got if p > TARGET_S]
    passed = [(p, a) for p, a in got if p <= TARGET_S]
    missed = sum(1 for _, a in got if a > TARGET_S)
    print(f"{len(got)} streamed requests, {args.streams} at once, silver target {TARGET_S:g}s; "
          f"{missed} missed it")
    print(f"admission would have refused {len(refused)}: {sum(1 for _, a in refused if a > TARGET_S)} of them "
          f"missed the target (refused rightly), {sum(1 for _, a in refused if a <= TARGET_S)} met it (refused "
          f"wrongly)")
    print(f"admission would have let through {len(passed)}: {sum(1 for _, a in passed if a > TARGET_S)} of them "
          f"missed the target")
    errors = [a - p for p, a in got]
    print(f"actual minus predicted TTFT: median {statistics.median(errors):+.2f}s, "
          f"p10 {sorted(errors)[len(errors) // 10]:+.2f}s, p90 {sorted(errors)[len(errors) * 9 // 10]:+.2f}s")
    for p, a in sorted(got)[:: max(1, len(got) // 12)]:
        print(f"  predicted {p:6.2f}s  actual {a:6.2f}s")


if __name__ == "__main__":
    main()

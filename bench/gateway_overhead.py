"""What the appliance's gateway costs: the same streaming workload sent straight to the vLLM port and
through the appliance, interleaved in one run against one engine.

    python bench/gateway_overhead.py [--requests 200] [--levels 1,8,32] [--max-tokens 16] [--rounds 4]
                                     [--without-admission]

Prints per concurrency level and path: p50/p99 time to first token and total latency, output tokens/s,
and the appliance/direct ratios. Goals (issue 2): added p50 latency under 1 ms, throughput at least 97%
of direct at 32 streams. Rounds alternate direct and appliance so drift in the machine hits both.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support import start_appliance

PROMPTS = ["Hello!", "Name a colour.", "What is 2+2?", "Say something nice.", "Capital of Italy?"]


@dataclass
class Sample:
    ttft: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    errors: int = 0
    requests: int = 0
    cpu: dict[str, float] = field(default_factory=dict)  # process name -> CPU seconds during this path's batches


def cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, p in procs.items():
        t = p.cpu_times()
        out[name] = t.user + t.system
    return out


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def one(client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int, s: Sample) -> None:
    body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = None
    n = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                s.errors += 1
                await r.aread()
                return
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"choices":[{' in line:  # one token per event here
                    n += 1
                    if first is None:
                        first = time.perf_counter()
    except httpx.HTTPError:
        s.errors += 1
        return
    end = time.perf_counter()
    s.ttft.append((first or end) - t0)
    s.total.append(end - t0)
    s.tokens += n


async def batch(client: httpx.AsyncClient, url: str, model: str, n: int, conc: int, max_tokens: int, s: Sample,
                procs: dict[str, psutil.Process] | None = None) -> None:
    sem = asyncio.Semaphore(conc)

    async def guarded(i: int) -> None:
        async with sem:
            await one(client, url, model, i, max_tokens, s)

    before = cpu_seconds(procs or {})
    t0 = time.perf_counter()
    await asyncio.gather(*(guarded(i) for i in range(n)))
    s.wall += time.perf_counter() - t0
    s.requests += n
    for name, v in cpu_seconds(procs or {}).items():
        s.cpu[name] = s.cpu.get(name, 0.0) + v - before[name]


async def run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-gw-"))
    # The bench's requests come without a key, so they take the anonymous class. Gold: admission runs
    # (its cost is measured) but holds no slots back, which silver's default would (a quarter reserved for
    # gold), queueing a quarter of 32 streams in the gateway and measuring policy, not overhead.
    admission = "enabled = false" if args.without_admission else 'anonymous_class = "gold"'
    app = start_appliance(tmp, enforce_eager=False, max_num_seqs=max(args.levels), extra=f"[admission]\n{admission}\n")
    try:
        print(f"starting the appliance and engine (log: {app.log_path}) ...", flush=True)
        app.wait_ready(900)
        key = (tmp / "state" / "engine.key").read_text().strip()
        paths = {
            "direct": (f"{app.engine_url}/v1/completions", {"Authorization": f"Bearer {key}"}),
            "appliance": (f"{app.url}/v1/completions", {}),
        }
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        clients = {name: httpx.AsyncClient(headers=h, timeout=300, limits=limits) for name, (_, h) in paths.items()}
        engine_front = next(p for p in app.engine_processes() if "api_server" in " ".join(p.cmdline()))
        procs = {"appliance": psutil.Process(app.proc.pid), "vllm-api": engine_front}
        # warm both paths (connections, engine caches)
        for name, (url, _) in paths.items():
            await batch(clients[name], url, app.served_name, 8, 8, args.max_tokens, Sample())

        print(f"\n{args.requests} requests per path and level, {args.max_tokens} output tokens each, "
              f"{args.rounds} interleaved rounds\n")
        hdr = f"{'streams':>7} {'path':>9} {'ttft p50':>9} {'ttft p99':>9} {'total p50':>10} {'total p99':>10} {'tok/s':>8} {'err':>4}"
        print(hdr)
        print("-" * len(hdr))
        for conc in args.levels:
            results = {name: Sample() for name in paths}
            per_round = max(1, args.requests // args.rounds)
            for rnd in range(args.rounds):
                order = list(paths) if rnd % 2 == 0 else list(reversed(paths))
                for name in order:
                    await batch(clients[name], paths[name][0], app.served_name, per_round, conc, args.max_tokens,
                                results[name], procs)
            for name, s in results.items():
                print(f"{conc:>7} {name:>9} {pct(s.ttft, 50)*1e3:>8.1f}ms {pct(s.ttft, 99)*1e3:>8.1f}ms "
                      f"{pct(s.total, 50)*1e3:>9.1f}ms {pct(s.total, 99)*1e3:>9.1f}ms {s.tokens / s.wall:>8.1f} "
                      f"{s.errors:>4}")
            d, a = results["direct"], results["appliance"]
            added_ttft = (pct(a.ttft, 50) - pct(d.ttft, 50)) * 1e3
            added_total = (pct(a.total, 50) - pct(d.total, 50)) * 1e3
            thr = (a.tokens / a.wall) / (d.tokens / d.wall)
            a_cpu = 1e3 * a.cpu["appliance"] / a.requests
            v_cpu = 1e3 * a.cpu["vllm-api"] / a.requests
            print(f"{conc:>7} {'cpu':>9} appliance {a_cpu:.2f} ms CPU per request vs vLLM's own API server "
                  f"{v_cpu:.2f} ms ({a_cpu / v_cpu:.2f}x); both share the one core the engine leaves free")
            print(f"{conc:>7} {'ratio':>9} ttft p50 {pct(a.ttft, 50) / pct(d.ttft, 50):.3f}x (+{added_ttft:.2f} ms), "
                  f"total p50 {pct(a.total, 50) / pct(d.total, 50):.3f}x (+{added_total:.2f} ms), "
                  f"throughput {thr:.3f}x of direct\n", flush=True)
        for c in clients.values():
            await c.aclose()
    finally:
        app.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--without-admission", action="store_true", help="turn admission control off in the gateway")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()

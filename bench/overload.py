"""Overload with and without admission control, side by side in one run.

    python bench/overload.py [--duration 40] [--capacity 4] [--load 3] [--max-tokens 32]
                             [--targets 1.5,3,6] [--mix 0.2,0.3,0.5]

Two appliances, identical but for `[admission] enabled`, run side by side (started together, both
warmed). The capacity is measured on each one's engine directly (its own socket, closed loop at `capacity`
streams, no gateway, no admission), and the mean of the two sets the offered rate: `load` times it for
`duration` seconds as open-loop Poisson arrivals, the requests drawn gold/silver/bronze by `mix` and
sent with a key of that class. The runs go A/B/A (with, without, with admission) on the same arrival
schedule, so a drift of the machine over the run shows as a difference between the two A runs. For each
run and class it prints goodput (requests answered with their first token within the class's TTFT
target, per second), p99 TTFT of the answered requests, and how many were refused (429/503) or failed;
then the ratios with/without admission, for each A run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from appliance.engine.args import ENGINE_BASE_URL
from appliance.store import keys
from tests.support import RunningAppliance, start_appliance

CLASSES = ("gold", "silver", "bronze")


@dataclass
class ClassResult:
    sent: int = 0
    good: int = 0
    refused: int = 0
    failed: int = 0
    ttft: list[float] = field(default_factory=list)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def admission_toml(enabled: bool, targets: dict[str, float]) -> str:
    lines = ["[admission]", f"enabled = {str(enabled).lower()}"]
    for cls in CLASSES:
        lines += [f"[admission.classes.{cls}]", f"ttft_target_s = {targets[cls]}"]
    return "\n".join(lines) + "\n"


def start(tag: str, capacity: int, enabled: bool, targets: dict[str, float]) -> tuple[RunningAppliance, dict]:
    """Started, not waited for: both appliances load at once."""
    d = Path(tempfile.mkdtemp(prefix=f"bench-overload-{tag}-"))
    db = d / "state" / "appliance.db"
    db.parent.mkdir(parents=True)
    secrets = {c: keys.create(db, f"bench-{c}", priority_class=c)[1] for c in CLASSES}
    app = start_appliance(d, max_num_seqs=capacity, extra=admission_toml(enabled, targets))
    print(f"[{tag}] starting the appliance (log: {app.log_path}) ...", flush=True)
    return app, secrets


def engine_key(app: RunningAppliance) -> str:
    """The engine's internal key (the daemon writes it beside its state for operators)."""
    return (app.config.parent / "state" / "engine.key").read_text().strip()


async def one(client: httpx.AsyncClient, base_url: str, model: str, key: str, max_tokens: int,
              timeout: float) -> tuple[str, float | None]:
    body = {"model": model, "prompt": "Tell me about the weather.", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", f"{base_url}/v1/completions", json=body,
                                     headers={"Authorization": f"Bearer {key}"}) as r:
                if r.status_code in (429, 503):
                    await r.aread()
                    return "refused", None
                if r.status_code != 200:
                    await r.aread()
                    return "failed", None
                ttft = None
                async for line in r.aiter_lines():
                    if ttft is None and line.startswith("data: {"):
                        ttft = time.perf_counter() - t0
                return ("ok", ttft) if ttft is not None else ("failed", None)
    except (TimeoutError, httpx.HTTPError):
        return "failed", None


async def capacity_rps(app: RunningAppliance, streams: int, max_tokens: int, seconds: float) -> float:
    """Requests per second the engine itself completes at `streams` concurrent streams (its own socket)."""
    done = 0
    deadline = time.perf_counter() + seconds
    key = engine_key(app)
    engine = httpx.AsyncHTTPTransport(uds=str(app.engine_socket))  # the engine listens on a private Unix socket
    async with httpx.AsyncClient(timeout=300, transport=engine) as client:
        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                status, _ = await one(client, ENGINE_BASE_URL, app.served_name, key, max_tokens, 300)
                done += status == "ok"
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        return done / (time.perf_counter() - t0)


async def offer(app: RunningAppliance, secrets: dict, rate: float, duration: float, mix: list[float],
                targets: dict[str, float], max_tokens: int, seed: int) -> dict[str, ClassResult]:
    rng = random.Random(seed)  # the same arrivals and classes for both appliances
    results = {c: ClassResult() for c in CLASSES}
    tasks: list[asyncio.Task] = []
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        async def tracked(cls: str) -> None:
            status, ttft = await one(client, app.url, app.served_name, secrets[cls], max_tokens, timeout=duration)
            r = results[cls]
            if status == "ok":
                r.ttft.append(ttft)
                r.good += ttft <= targets[cls]
            elif status == "refused":
                r.refused += 1
            else:
                r.failed += 1

        # The schedule is drawn up front, so both appliances get exactly the same arrivals.
        schedule, t = [], rng.expovariate(rate)
        while t < duration:
            schedule.append((t, rng.choices(CLASSES, weights=mix)[0]))
            t += rng.expovariate(rate)
        start = time.perf_counter()
        for at, cls in schedule:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            results[cls].sent += 1
            tasks.append(asyncio.create_task(tracked(cls)))
        await asyncio.gather(*tasks)
    return results


def report(tag: str, res: dict[str, ClassResult], duration: float, targets: dict[str, float]) -> None:
    print(f"\n{tag}")
    print(f"{'class':>7} {'target':>7} {'sent':>5} {'good':>5} {'goodput/s':>10} {'p99 ttft':>9} {'refused':>8} "
          f"{'failed':>7}")
    for cls in CLASSES:
        r = res[cls]
        print(f"{cls:>7} {targets[cls]:>6.1f}s {r.sent:>5} {r.good:>5} {r.good / duration:>10.2f} "
              f"{pct(r.ttft, 99):>8.2f}s {r.refused:>8} {r.failed:>7}")
    total = sum(r.good for r in res.values())
    print(f"{'all':>7} {'':>7} {sum(r.sent for r in res.values()):>5} {total:>5} {total / duration:>10.2f}")


async def main(args: argparse.Namespace) -> None:
    targets = dict(zip(CLASSES, (float(x) for x in args.targets.split(",")), strict=False))
    mix = [float(x) for x in args.mix.split(",")]
    apps = {"with": start("with", args.capacity, True, targets), "without": start("without", args.capacity, False, targets)}
    try:
        for app, _ in apps.values():
            app.wait_ready(900)
        caps = {}
        for tag, (app, _secrets) in apps.items():  # warm each engine, then measure it on its own socket
            await capacity_rps(app, args.capacity, args.max_tokens, 3)
            caps[tag] = await capacity_rps(app, args.capacity, args.max_tokens, args.calibrate)
        rate = args.load * sum(caps.values()) / len(caps)
        print(f"engine capacity (measured on each engine's own socket) {caps['with']:.2f} and {caps['without']:.2f} "
              f"requests/s at {args.capacity} streams of {args.max_tokens} tokens; offering {rate:.2f}/s "
              f"({args.load:g}x their mean) for {args.duration:g}s per run, A/B/A", flush=True)
        runs: list[tuple[str, dict[str, ClassResult]]] = []
        for tag in ("with", "without", "with"):
            app, secrets = apps[tag]
            runs.append((tag, await offer(app, secrets, rate, args.duration, mix, targets, args.max_tokens, args.seed)))
    finally:
        for app, _ in apps.values():
            app.stop()
    for i, (tag, res) in enumerate(runs, 1):
        report(f"run {i}: {tag} admission", res, args.duration, targets)
    without = runs[1][1]
    for i in (0, 2):
        on = runs[i][1]
        print(f"\nratios, run {i + 1} (with admission) / run 2 (without):")
        for cls in (*CLASSES, "all"):
            pick = CLASSES if cls == "all" else (cls,)
            good_on, good_off = sum(on[c].good for c in pick), sum(without[c].good for c in pick)
            ratio = f"{good_on / good_off:.2f}x" if good_off else f"{good_on} vs 0"
            p_on = pct([t for c in pick for t in on[c].ttft], 99)
            p_off = pct([t for c in pick for t in without[c].ttft], 99)
            target = f" (target {targets[cls]:g}s: {'met' if p_on <= targets[cls] else 'MISSED'})" if cls in targets else ""
            print(f"{cls:>7}: goodput {ratio:>8}   p99 ttft {p_on:.2f}s vs {p_off:.2f}s{target}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=40)
    ap.add_argument("--capacity", type=int, default=4, help="engine max_num_seqs")
    ap.add_argument("--load", type=float, default=3.0, help="offered load as a multiple of capacity")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--targets", default="1.5,3,6", help="TTFT targets in seconds: gold,silver,bronze")
    ap.add_argument("--mix", default="0.2,0.3,0.5", help="share of requests: gold,silver,bronze")
    ap.add_argument("--calibrate", type=float, default=15, help="seconds to measure capacity")
    ap.add_argument("--seed", type=int, default=7)
    asyncio.run(main(ap.parse_args()))

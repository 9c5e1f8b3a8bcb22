"""The outbox under an outage: escalations queued with the link cut, then the link restored.

    python bench/outbox.py [--regional pd|canned] [--count N] [--concurrency 4] [--outage 5]

The appliance's own outbox, forwarder and regional client (the code the daemon runs), in one process,
behind the TCP fault injector and the tests' recording gateway front (tests/regional.py), against:

- `pd` (default): the disaggregated regional stand-in (tests/pd_cluster.py), real prefill and decode vLLM
  CPU servers sharing KV through ExampleConnector. Each escalation is a long prompt (a document and a
  question, 150 to 900 tokens) with its llm-d headers on, 200 of them by default. Also prints how much
  of decode's work came from the KV prefill transferred.
- `canned`: no model, a fixed answer at once, so what is measured is the appliance's side alone (SQLite
  writes, claims, HTTP round trips); 10,000 escalations by default.

Prints the rate escalations are stored at (each one a durable transaction), the drain rate once the link
is back, and the delivery judged on every request the front received: each escalation's body applied
exactly once and under its own id, nothing without a key or under a key that is no escalation id.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from appliance.boot.config import default_objectives
from cascade.forwarder import Forwarder
from cascade.gateway_headers import GatewayHeaders
from cascade.outbox import Outbox
from cascade.regional import RegionalClient, RegionalSettings
from tests.pd_cluster import PDCluster
from tests.regional import FaultInjector, RegionalRecorder, marker

MODEL = "regional"
FACTS = [f"Line {i}: unit {i % 11} reported pressure {40 + i % 17} kPa at {i % 24:02d}:00." for i in range(80)]


def question(i: int, m: str) -> str:
    """A hard query as an escalation carries it: the marker first (no prefix of it is cached anywhere),
    then a document of 6 to 66 lines (150 to 900 tokens), then the question."""
    lines = FACTS[: 6 + (i * 7) % 61]
    return f"{m}\n" + "\n".join(lines) + f"\nWhich unit reported the highest pressure, and when? ({i})"


async def main(args: argparse.Namespace) -> None:
    cluster = None
    # the P/D stand-in's KV store grows by GBs in a run: both folders go at the end, as a test's tmp_path does
    pd_dir = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    if args.regional == "pd":
        cluster = PDCluster(pd_dir, served_name=MODEL)
        t = time.perf_counter()
        try:
            cluster.wait_ready()
        except BaseException:
            cluster.stop()  # one server up and the other failed: leave no engine behind
            shutil.rmtree(pd_dir, ignore_errors=True)
            raise
        print(f"P/D stand-in ready in {time.perf_counter() - t:.0f}s: prefill {cluster.prefill.url}, "
              f"decode {cluster.decode.url}, sidecar {cluster.url}")
        recorder = RegionalRecorder(cluster.url)
    else:
        recorder = RegionalRecorder("http://unused")
        recorder.behaviour = "canned"
    injector = FaultInjector(recorder.port)
    injector.set("cut")
    tmp = Path(tempfile.mkdtemp(prefix="bench-outbox-"))
    box = Outbox(tmp / "outbox.db", max_pending=args.count)
    try:
        markers = [marker() for _ in range(args.count)]  # each body its own, so a duplicate under any key shows
        t = time.perf_counter()
        ids = [box.put("/v1/chat/completions",
                       {"model": MODEL, "max_tokens": args.max_tokens, "temperature": 0,
                        "messages": [{"role": "user", "content": question(i, m)}]},
                       priority_class=("gold", "silver", "bronze")[i % 3], tenant=f"tenant-{i % 5}").id
               for i, m in enumerate(markers)]
        stored = time.perf_counter() - t
        print(f"stored {args.count} escalations in {stored:.1f}s ({args.count / stored:.0f}/s, one durable "
              f"transaction each)")

        client = RegionalClient(RegionalSettings(base_url=f"http://127.0.0.1:{injector.port}/v1", model=MODEL,
                                                 connect_timeout_s=1, read_timeout_s=120, breaker_failures=2,
                                                 breaker_reset_s=1, breaker_max_reset_s=2,
                                                 gateway=GatewayHeaders(default_objectives(), site="bench")))
        fwd = Forwarder(box, client, concurrency=args.concurrency, poll_s=0.2)
        task = asyncio.create_task(fwd.run())
        await asyncio.sleep(args.outage)
        during = box.stats()
        print(f"link cut for {args.outage:g}s with the forwarder running: {during['depth']} waiting, "
              f"breaker {client.breaker.state}, {sum(recorder.received.values())} reached the regional side")
        injector.set("pass")
        t = time.perf_counter()
        while box.stats()["counts"]["done"] < args.count:
            await asyncio.sleep(0.2)
            if time.perf_counter() - t > args.timeout:
                break
            if cluster is not None and (dead := cluster.exited()):
                sys.exit("the regional stand-in died mid-run:\n" + "\n".join(dead))
        drained = time.perf_counter() - t
        task.cancel()
        await client.aclose()
        st = box.stats()
        problems = recorder.delivery_problems(dict(zip(ids, markers, strict=True)))
        applied = recorder.applied
        delivered = sum(1 for i in ids if applied[i] >= 1)
        resent = sum(recorder.received[i] for i in ids) - len([i for i in ids if recorder.received[i]])
        print(f"link restored: drained in {drained:.1f}s ({st['counts']['done'] / drained:.3g} escalations/s at "
              f"concurrency {args.concurrency})")
        print(f"delivered {delivered}, lost {args.count - delivered}; {len(recorder.arrivals)} requests received, "
              f"{len(recorder.applications)} applied; resent with the same key {resent}; outbox now {st['counts']}")
        print(f"delivery problems (duplicates under any key, keyless or foreign keys, missing): {len(problems)}")
        for line in problems[:20]:
            print(f"  {line}")
        if cluster is not None:
            print(f"P/D: {cluster.transfer()}")
            objectives = {a.scheduling.get("x-gateway-inference-objective") for a in recorder.arrivals}
            print(f"llm-d objectives received: {sorted(o or '(none)' for o in objectives)}")
        if problems:
            sys.exit(1)
    finally:
        box.close()
        injector.close()
        recorder.close()
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(pd_dir, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regional", choices=("pd", "canned"), default="pd")
    ap.add_argument("--count", type=int, help="escalations (default: 200 against pd, 10,000 canned)")
    ap.add_argument("--max-tokens", type=int, default=16, help="of each regional answer")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--outage", type=float, default=5.0)
    ap.add_argument("--timeout", type=float, default=1800.0)
    parsed = ap.parse_args()
    parsed.count = parsed.count or (200 if parsed.regional == "pd" else 10_000)
    asyncio.run(main(parsed))

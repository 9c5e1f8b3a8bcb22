"""The outbox under a long outage: 10,000 escalations queued with the link cut, then the link restored.

    python bench/outbox.py [--count 10000] [--concurrency 4] [--outage 5]

The appliance's own outbox, forwarder and regional client (the code the daemon runs), in one process,
against the tests' recording regional front (tests/regional.py) in its canned mode: no model behind it,
it answers every request at once with a fixed chat completion, so what is measured is the appliance's
side (SQLite writes, claims, HTTP round trips) behind the TCP fault injector. Prints the rate
escalations are stored at (each one a durable transaction), the drain rate once the link is back, and
the delivery judged on every request the front received: each escalation's body applied exactly once
and under its own id, nothing without a key or under a key that is no escalation id.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cascade.forwarder import Forwarder
from cascade.outbox import Outbox
from cascade.regional import RegionalClient, RegionalSettings
from tests.regional import FaultInjector, RegionalRecorder, marker


async def main(args: argparse.Namespace) -> None:
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
                       {"model": "regional", "max_tokens": 64,
                        "messages": [{"role": "user", "content": f"A question the local model doubts. {m}"}]},
                       priority_class=("gold", "silver", "bronze")[i % 3]).id
               for i, m in enumerate(markers)]
        stored = time.perf_counter() - t
        print(f"stored {args.count} escalations in {stored:.1f}s ({args.count / stored:.0f}/s, one durable "
              f"transaction each)")

        client = RegionalClient(RegionalSettings(base_url=f"http://127.0.0.1:{injector.port}/v1", model="regional",
                                                 connect_timeout_s=1, read_timeout_s=10, breaker_failures=2,
                                                 breaker_reset_s=1, breaker_max_reset_s=2))
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
        drained = time.perf_counter() - t
        task.cancel()
        await client.aclose()
        st = box.stats()
        problems = recorder.delivery_problems(dict(zip(ids, markers)))
        applied = recorder.applied
        delivered = sum(1 for i in ids if applied[i] >= 1)
        resent = sum(recorder.received[i] for i in ids) - len([i for i in ids if recorder.received[i]])
        print(f"link restored: drained in {drained:.1f}s ({st['counts']['done'] / drained:.0f} escalations/s at "
              f"concurrency {args.concurrency})")
        print(f"delivered {delivered}, lost {args.count - delivered}; {len(recorder.arrivals)} requests received, "
              f"{len(recorder.applications)} applied; resent with the same key {resent}; outbox now {st['counts']}")
        print(f"delivery problems (duplicates under any key, keyless or foreign keys, missing): {len(problems)}")
        for line in problems[:20]:
            print(f"  {line}")
        if problems:
            sys.exit(1)
    finally:
        box.close()
        injector.close()
        recorder.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--outage", type=float, default=5.0)
    ap.add_argument("--timeout", type=float, default=1200.0)
    asyncio.run(main(ap.parse_args()))

"""The long fuzz run (issue 15's done-when): 10,000 hostile requests, then raw-socket cases, against the real
appliance and its real engine, with the configuration the fuzz test uses (tests/fuzz/campaign.Limits).

    python bench/fuzz.py [--requests 10000] [--connections 1000] [--concurrency 8] [--seed N]

Prints the statuses and error codes seen, the daemon's memory after each tenth of the requests (the first
tenth is warm-up: flat means what comes after it), and every problem: a 500, an error that is not an
OpenAI body, an ordinary request refused, a request with no answer in time, a lost request-log row, an
engine restart, a logged traceback, a connection left unanswered. Exits 1 when there is any.
`make fuzz` runs it; tests/integration/test_fuzz.py runs a bounded budget of the same in the suite.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.fuzz.campaign import Limits, daemon_tracebacks, run_campaign
from tests.fuzz.wire import draw_wire_probes, probe_all
from tests.support import start_appliance


def main(args: argparse.Namespace) -> int:
    limits = Limits()
    app = start_appliance(Path(tempfile.mkdtemp(prefix="bench-fuzz-")), server_extra=limits.server_toml(),
                          extra=limits.admission_toml())
    try:
        app.wait_ready()
        last = [time.monotonic()]

        def progress(n: int) -> None:
            if time.monotonic() - last[0] > 30:
                last[0] = time.monotonic()
                print(f"  {n} requests sent", flush=True)

        report = run_campaign(app, args.requests, args.seed, limits, args.concurrency, samples=10, progress=progress)
        print(report.summary())
        warm = report.rss[0][1]
        print(f"daemon memory after warm-up {warm:.1f} MiB, at the end {report.rss[-1][1]:.1f} MiB "
              f"({report.rss[-1][1] - warm:+.1f} MiB over {report.rss[-1][0] - report.rss[0][0]} requests)")

        t = time.monotonic()
        drawn = draw_wire_probes(args.connections, args.seed)
        wire = asyncio.run(probe_all(app.port, drawn, concurrency=16,
                                     deadline_s=limits.header_timeout_s + limits.body_timeout_s + 20))
        print(f"raw sockets: {len(drawn)} connections in {time.monotonic() - t:.0f}s, {len(wire)} problems")
        problems = report.problems + wire
        if daemon_tracebacks(app.log_text()):
            problems.append("the daemon's log has a traceback")
        for p in problems[:40]:
            print(f"PROBLEM {p[:2000]}")
        print(f"{len(problems)} problems (seed {args.seed})")
        return 1 if problems else 0
    finally:
        app.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--connections", type=int, default=1_000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=random.randrange(2**32))
    sys.exit(main(parser.parse_args()))

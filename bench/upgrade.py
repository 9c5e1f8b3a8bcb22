"""Upgrades under load: time to ready cold and warm, the hold clients saw, and errors, in one run.

    python bench/upgrade.py [--clients 8] [--probation 30]

One appliance on the default configuration (the engine compiles: no --enforce-eager), its engine cache
empty at first:
  1. time to ready, cold (empty compile cache), then warm (the daemon restarted on the same cache);
  2. `clients` streaming chat clients, back to back, through an upgrade to another build of the default
     model (converted to float16: other bytes, same answers nearly), which commits (upgrade.swap auto:
     beside the running engine where the host has the memory);
  3. the same clients through `rollback` in place (the old engine drained and stopped, new requests held
     while the previous build loads: the way on a GPU without room for two);
  4. the same clients through an upgrade to a build that loads but answers garbage (the final norm
     negated), which the golden-set gate must refuse, leaving the running engine as it was.
For each upgrade: the result, the seconds from the swap's start to an engine serving again (the new one,
or the old one after the rollback), requests answered and failed, and the hold clients saw (time to the
first byte of the answers that started during the swap, against the p50 before it).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests import loopback, model_builds
from tests.support import RunningAppliance, default_model_path, launch_appliance, write_config


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


class Clients:
    """Streaming chat clients, back to back; each answer's start, first byte, end and outcome kept."""

    def __init__(self, app: RunningAppliance, n: int) -> None:
        self.app, self.stop, self.results = app, threading.Event(), []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        body = {"model": self.app.served_name, "stream": True, "max_tokens": 32, "temperature": 0,
                "messages": [{"role": "user", "content": f"Tell me a fact about the number {i}."}]}
        while not self.stop.is_set():
            rec: dict = {"started": time.time()}
            try:
                with loopback.stream("POST", f"{self.app.url}/v1/chat/completions", json=body, timeout=900) as r:
                    rec["first_byte"] = time.time()
                    lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                rec["ok"] = r.status_code == 200 and bool(lines) and lines[-1] == "data: [DONE]"
            except httpx.HTTPError:
                rec["ok"] = False
            rec["ended"] = time.time()
            self.results.append(rec)

    def finish(self) -> list[dict]:
        self.stop.set()
        for t in self.threads:
            t.join(900)
        return self.results


def time_to_ready(cfg: Path, d: Path) -> tuple[RunningAppliance, float]:
    t = time.monotonic()
    app = launch_appliance(cfg, d)
    app.wait_ready(1800)
    return app, time.monotonic() - t


def upgrade(app: RunningAppliance, build: Path | None) -> dict:
    """One upgrade (a rollback in place when build is None) under the clients' load; the steps as they
    were seen, and the outcome."""
    if build is None:
        r = loopback.post(f"{app.url}/v1/appliance/rollback", timeout=60, json={"swap": "in_place"})
    else:
        r = loopback.post(f"{app.url}/v1/appliance/upgrade", timeout=60,
                          json={"model": str(build), "digest": model_builds.digest(build)})
    r.raise_for_status()
    attempt_id, steps = r.json()["started"]["id"], []
    while True:
        st = loopback.get(f"{app.url}/v1/appliance/upgrade", timeout=30).json()
        if st["running"] and st["running"]["id"] == attempt_id:
            steps = st["running"]["steps"]
        elif st["last"] and st["last"]["id"] == attempt_id:
            return {"steps": steps, "last": st["last"], "ended": time.time()}
        time.sleep(0.5)


def report(name: str, run: dict, results: list[dict], since: float) -> None:
    at = {s["step"]: s["at"] for s in run["steps"]}
    swap = at.get("swap", since)
    back = at.get("probation", run["ended"])  # the new engine serves; or the rollback ended
    how = next((s["message"] for s in run["steps"] if s["step"] == "swap"), "")
    mine = [r for r in results if since <= r["started"] <= run["ended"]]
    before = [r["first_byte"] - r["started"] for r in results if r["ended"] < swap and "first_byte" in r]
    during = [r["first_byte"] - r["started"] for r in mine if swap <= r["started"] <= back and "first_byte" in r]
    failed = sum(not r["ok"] for r in mine)
    print(f"{name}: {run['last']['result']} at {run['last']['step']} ({run['last']['reason'][:100]})")
    print(f"  swap: {how[:110]}")
    print(f"  stage {swap - since:6.1f} s; swap to the new engine serving (or the rollback's end) {back - swap:6.1f} s; "
          f"requests {len(mine)}, failed {failed}")
    print(f"  first byte: p50 before {pct(before, 50):.2f} s; started during the swap: {len(during)}, "
          f"p50 {pct(during, 50):.1f} s, max {max(during, default=float('nan')):.1f} s (the hold)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--probation", type=float, default=30.0, help="upgrade.probation_s (default config: 300)")
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="bench-upgrade-"))
    src = default_model_path()
    good, bad = model_builds.converted(src, d / "fp16"), model_builds.garbled(src, d / "garbled")
    cfg = write_config(d, enforce_eager=False, cache_dir=d / "engine-cache",
                       extra=f"[upgrade]\nprobation_s = {a.probation}\n")
    app, cold = time_to_ready(cfg, d)
    app.stop(signal.SIGTERM)
    app, warm = time_to_ready(cfg, d)
    print(f"time to ready: cold {cold:.1f} s (empty compile cache), warm {warm:.1f} s")
    try:
        clients = Clients(app, a.clients)
        time.sleep(20)
        runs = []
        for name, build in (("upgrade to the float16 build", good), ("rollback in place", None),
                            ("upgrade to the garbled build", bad)):
            t = time.time()
            runs.append((name, upgrade(app, build), t))
        time.sleep(5)
        results = clients.finish()
        for name, run, t in runs:
            report(name, run, results, t)
        print(f"all requests: {len(results)}, failed {sum(not r['ok'] for r in results)}")
    finally:
        app.stop()


if __name__ == "__main__":
    main()

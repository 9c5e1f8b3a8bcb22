"""How long `appliance plan` takes with vLLM's probe and with the kvbudget model alone, side by side.

Runs the CLI a user runs (`appliance plan --json`), alternating the two paths, for a dense model, a
Gated DeltaNet hybrid and an MLA model on a named card (emulated CUDA platform) and on this machine's
platform. Prints the median wall time of each path and their ratio; the issue's goal is a plan with
the probe in seconds, not tens of seconds.

    .venv/bin/python bench/plan_speed.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "models"
CASES = [
    ("llama-3.1-8b", ["--gpu", "H100"]),
    ("qwen3.6-27b", ["--gpu", "RTX PRO 6000 Blackwell"]),
    ("deepseek-v2-lite-chat", ["--gpu", "H100", "--kv-dtype", "fp8"]),
    ("granite-4.0-h-tiny", ["--cpu", "--kv-pool", "4GiB"]),
]
GOAL_S = 10.0


def run(model: str, extra: list[str], model_only: bool) -> float:
    cmd = [sys.executable, "-m", "appliance.cli", "plan", "--model", str(FIX / f"{model}.json"), "--context", "32768",
           "--json", *extra, *(["--model-only"] if model_only else [])]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    took = time.perf_counter() - start
    if done.returncode not in (0, 1) or '"source"' not in done.stdout:
        sys.exit(f"plan failed for {model}: {done.stderr[-2000:]}")
    want = "kvbudget model" if model_only else "vllm "
    if want not in done.stdout:
        sys.exit(f"{model}: expected figures from {want!r}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    print(f"{'model':<24} {'target':<32} {'model only s':>12} {'with vLLM s':>12} {'ratio':>7}")
    worst = 0.0
    for model, extra in CASES:
        alone, probed = [], []
        for _ in range(a.rounds):  # interleaved, so both paths see the same machine load
            alone.append(run(model, extra, True))
            probed.append(run(model, extra, False))
        m_alone, m_probed = statistics.median(alone), statistics.median(probed)
        worst = max(worst, m_probed)
        print(f"{model:<24} {' '.join(extra):<32} {m_alone:>12.2f} {m_probed:>12.2f} {m_probed / m_alone:>6.1f}x")
    print(f"slowest plan with the probe: {worst:.1f} s (goal: seconds, under {GOAL_S:.0f} s): "
          f"{'met' if worst < GOAL_S else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

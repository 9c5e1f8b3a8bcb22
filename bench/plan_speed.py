"""How long planning takes for each fixture model.

    python bench/plan_speed.py [--repeat 200] [--gpu NAME]

kvbudget plans from config.json alone, in well under a millisecond. For scale: vLLM sizes its KV cache
only after loading the weights and a profiling run; its CPU engine here logs "init engine (profile,
create kv cache, warmup model) took" 30-70 s for the 135M default model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbudget.model import read_model  # noqa: E402
from kvbudget.planner import Targets, make_plan  # noqa: E402
from kvbudget.profiles import find_profile  # noqa: E402

FIX = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "models"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--gpu", default="RTX PRO 6000 Blackwell")
    args = ap.parse_args()
    gpu = find_profile(args.gpu)
    print(f"{'model':24} {'read (ms)':>10} {'plan p50 (ms)':>14} {'plan max (ms)':>14}  result")
    for path in sorted(FIX.glob("*.json")):
        if path.stem == "not-a-causal-lm":
            continue
        t0 = time.perf_counter()
        model = read_model(path)
        read_ms = (time.perf_counter() - t0) * 1e3
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            plan = make_plan(model, gpu, Targets(sessions=20, context=32_768))
            times.append((time.perf_counter() - t0) * 1e3)
        result = "does not fit" if not plan.fits else f"{plan.capacity.max_concurrency:.1f} sessions at 32k"
        print(f"{path.stem:24} {read_ms:>10.2f} {statistics.median(times):>14.3f} {max(times):>14.3f}  {result}")


if __name__ == "__main__":
    main()

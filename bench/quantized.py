"""The embedded default's bf16 build against each quantized scheme vLLM's CPU build runs, and bf16 KV
against FP8 KV, in one run (issue 32's benchmark): the same questions to each, greedy; accuracy, agreement
with the bf16 build, output tokens/s at 1 and 16 streams, resident memory (PSS) and KV tokens.

    python bench/quantized.py [--per-task 100] [--tasks sciq,boolq,triviaqa]

The builds are made fresh by `appliance model quantize --no-gate` from the current code (the gate is this
comparison). Questions: the project's shipped set plus, where `make bench-deps` installed the eval data,
SciQ, BoolQ and TriviaQA as bench/cascade_eval.py draws them. Each build is served in turn by a bare vLLM
engine with make run's settings (quantize/compare.py). FP8 KV is asked of the bf16 build; where the host
lacks AVX-512, vLLM refuses it and the refusal is reported.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import cascade_eval  # noqa: E402
from kvbudget.cpu import cpu_flags, isa_from_flags  # noqa: E402
from quantize import compare  # noqa: E402
from tests.support import default_model_path  # noqa: E402

SCHEMES = ("w8a8-int8", "w4a16")


def questions(tasks: list[str], per_task: int, seed: int) -> tuple[list[compare.EvalItem], str]:
    items = compare.read_eval(compare.SHIPPED_EVAL)
    said = [f"{len(items)} shipped"]
    rng = random.Random(seed)
    for task in tasks:
        try:
            drawn = cascade_eval.load(task, per_task, rng)
        except SystemExit as e:  # the eval data is not installed
            print(f"  ({task} left out: {e})")
            continue
        items += [compare.EvalItem(({"role": "user", "content": i.prompt},), i.gold, i.wrong) for i in drawn]
        said.append(f"{len(drawn)} {task}")
    return items, " + ".join(said)


def build(source: Path, out: Path, scheme: str, log: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "appliance.cli", "model", "quantize", str(source), "--scheme", scheme,
                          "--out", str(out), "--no-gate"], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ))
    if run.returncode != 0:
        sys.exit(f"quantizing {scheme} failed:\n{run.stderr[-2000:]}\n(log: {log})")


def row(name: str, run: compare.Run, base: compare.Run, items: list[compare.EvalItem]) -> str:
    c = compare.Comparison(items, base, run)
    tok = "  ".join(f"{run.tok_s[s]:6.1f} ({run.tok_s[s] / base.tok_s[s]:.2f}x)" for s in run.tok_s)
    acc = run.accuracy(items)
    return (f"{name:>16} {acc:8.1%} {c.agreement:9.1%} {run.pss_bytes / 2**20:7.0f}Mi ({run.pss_bytes / base.pss_bytes:.2f}x)"
            f" {run.kv_tokens or 0:>9,}  {tok}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="sciq,boolq,triviaqa")
    ap.add_argument("--per-task", type=int, default=100)
    ap.add_argument("--seed", type=int, default=20261126)
    args = ap.parse_args()
    source = default_model_path()
    work = Path(tempfile.mkdtemp(prefix="bench-quantized-"))
    log = work / "engine.log"
    items, said = questions([t for t in args.tasks.split(",") if t], args.per_task, args.seed)
    print(f"host: {isa_from_flags(cpu_flags())}; {len(items)} questions ({said}); engine log {log}")
    for scheme in SCHEMES:
        print(f"quantizing the default as {scheme} ...")
        build(source, work / scheme, scheme, work / f"{scheme}.quantize.log")
    print("serving each in turn ...")
    runs = {"bf16": compare.run(source, items, log=log)}
    try:
        runs["bf16 + FP8 KV"] = compare.run(source, items, log=log, kv_dtype="fp8")
    except compare.CompareError as e:
        print(f"  FP8 KV refused on this host: {e}")
    for scheme in SCHEMES:
        runs[scheme] = compare.run(work / scheme, items, log=log)
    base = runs["bf16"]
    print(f"\n{'build':>16} {'accuracy':>8} {'agree':>9} {'PSS':>17} {'KV tokens':>9}  tok/s at 1 and 16 streams (x bf16)")
    for name, run in runs.items():
        print(row(name, run, base, items))
    closest = max(SCHEMES, key=lambda s: compare.Comparison(items, base, runs[s]).agreement)
    print(f"\nthe scheme whose answers agree most with bf16 here: {closest}")


if __name__ == "__main__":
    main()

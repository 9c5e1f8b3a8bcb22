"""Two builds of a model side by side on the same prompts (issue 32, item 3): each served in turn by a bare
vLLM engine (the engine's own environment, offline, the same settings for both), asked the eval set's
questions greedily, then timed at 1 and 16 streams; their answers compared.

What it reports: each build's accuracy where the eval set carries answers (an expected answer in the
reply, as the cascade benchmark scores them), the two builds' agreement (cascade.labels' comparison:
the same choice, exact, contained or token F1 >= 0.5), output tokens/s, and resident memory (PSS of the
engine's processes, so shared pages count once). The loss a gate bounds is the accuracy lost, or where
the set has no answers, the share of answers that disagree.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from appliance.engine.args import engine_env
from cascade.labels import agreement, normalise
from quantize.jsonl import numbered_lines

SHIPPED_EVAL = Path(__file__).with_name("eval.jsonl")
_TIMED_TOKENS = 64
_KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")  # vLLM's start-up line, CPU and GPU alike
_START_S = 600


class CompareError(RuntimeError):
    """A build could not be served or asked; the message says which and where its log is."""


@dataclass(frozen=True)
class EvalItem:
    messages: tuple[dict, ...]
    answers: tuple[str, ...] = ()  # any of these in the reply is right; none: agreement only
    wrong: tuple[str, ...] = ()  # any of these in the reply makes it wrong (the other options of a choice)

    def correct(self, reply: str) -> bool:
        said = f" {normalise(reply)} "
        def has(texts: tuple[str, ...]) -> bool:
            return any(f" {normalise(t)} " in said for t in texts if normalise(t))

        return has(self.answers) and not has(self.wrong)


def read_eval(path: Path) -> list[EvalItem]:
    items = []
    for n, raw in numbered_lines(path, CompareError):
        try:
            messages = raw["messages"] if "messages" in raw else [{"role": "user", "content": raw["prompt"]}]
            items.append(EvalItem(tuple(messages), tuple(str(a) for a in raw.get("answers", ())),
                                  tuple(str(w) for w in raw.get("wrong", ()))))
        except (KeyError, TypeError) as e:
            raise CompareError(f'{path}:{n}: each line must be {{"messages": [...]}} or {{"prompt": "..."}}, with '
                               f'optional "answers" and "wrong": [...] ({e})') from None
    if not items:
        raise CompareError(f"{path} holds no questions")
    return items


@dataclass
class Run:
    folder: Path
    kv_dtype: str
    answers: list[str]
    tok_s: dict[int, float]
    pss_bytes: int
    kv_tokens: int | None = None  # as the engine logged its KV cache

    def accuracy(self, items: list[EvalItem]) -> float | None:
        scored = [(i, a) for i, a in zip(items, self.answers, strict=True) if i.answers]
        return sum(i.correct(a) for i, a in scored) / len(scored) if scored else None


@dataclass
class Comparison:
    items: list[EvalItem]
    a: Run
    b: Run
    agree: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.agree = [agreement(x, y).agree for x, y in zip(self.a.answers, self.b.answers, strict=True)]

    @property
    def agreement(self) -> float:
        return sum(self.agree) / len(self.agree)

    @property
    def loss(self) -> float:
        acc_a, acc_b = self.a.accuracy(self.items), self.b.accuracy(self.items)
        return acc_a - acc_b if acc_a is not None and acc_b is not None else 1 - self.agreement

    def render(self) -> str:
        def pct(v: float | None) -> str:
            return "-" if v is None else f"{v:.1%}"

        rows = [f"{'':>8} {'accuracy':>9} {'PSS':>9} " + " ".join(f"{f'tok/s@{s}':>10}" for s in self.a.tok_s)
                + "  build"]
        for name, run in (("A", self.a), ("B", self.b)):
            rows.append(f"{name:>8} {pct(run.accuracy(self.items)):>9} {run.pss_bytes / 2**20:>7.0f}Mi "
                        + " ".join(f"{run.tok_s[s]:>10.1f}" for s in run.tok_s) + f"  {run.folder} (KV {run.kv_dtype})")
        ratio = " ".join(f"{self.b.tok_s[s] / self.a.tok_s[s]:.2f}x@{s}" for s in self.a.tok_s)
        rows.append(f"agreement {self.agreement:.1%} of {len(self.items)} answers; B/A tokens/s {ratio}; "
                    f"memory B/A {self.b.pss_bytes / self.a.pss_bytes:.2f}x; loss {self.loss:+.1%}")
        return "\n".join(rows)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def served(folder: Path, *, python: str, log: Path, kv_dtype: str = "auto",
           kv_bytes: int = 1 << 30) -> Iterator[tuple[str, psutil.Process]]:
    """A bare vLLM engine on loopback serving folder as "m": make run's settings (2048 tokens of context,
    16 sequences, eager), offline; yields its base URL and process, and stops it however the block ends."""
    port = _free_port()
    args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name", "m",
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--max-num-seqs", "16",
            "--enforce-eager", "--kv-cache-memory-bytes", str(kv_bytes), "--kv-cache-dtype", kv_dtype]
    # The daemon's own engine environment (offline, INFO logging: the KV cache line is read from the log,
    # the planned pool winning), vLLM's default compile cache, its ZeroMQ sockets in a private folder.
    rpc_dir = Path(tempfile.mkdtemp(prefix="ae-compare-"))
    env = engine_env(os.environ, Path(os.environ.get("VLLM_CACHE_ROOT") or Path.home() / ".cache" / "vllm"), rpc_dir)
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, log)
        yield url, psutil.Process(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        shutil.rmtree(rpc_dir, ignore_errors=True)


def _wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + _START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CompareError(f"the engine exited with {proc.returncode} before serving; its log: {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise CompareError(f"the engine was not ready after {_START_S} s; its log: {log}")


def pss(proc: psutil.Process) -> int:
    """Proportional resident memory of the engine and its children (shared pages split between them)."""
    total = 0
    for p in (proc, *proc.children(recursive=True)):
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


async def _answers(url: str, items: list[EvalItem], max_tokens: int) -> list[str]:
    limit = asyncio.Semaphore(8)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def one(item: EvalItem) -> str:
            async with limit:
                r = await client.post("/v1/chat/completions", json={
                    "model": "m", "messages": list(item.messages), "max_tokens": max_tokens, "temperature": 0})
            if r.status_code != 200:
                raise CompareError(f"the engine answered {r.status_code}: {r.text[:300]}")
            return str(r.json()["choices"][0]["message"]["content"] or "")

        return list(await asyncio.gather(*(one(i) for i in items)))


async def _tokens_per_s(url: str, streams: int, rounds: int = 2) -> float:
    """Output tokens per second with `streams` requests always in flight, each _TIMED_TOKENS long."""
    body = {"model": "m", "max_tokens": _TIMED_TOKENS, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me about the history of bread."}]}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await client.post("/v1/chat/completions", json=body)  # warm
        start, tokens = time.perf_counter(), 0
        for _ in range(rounds):
            done = await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(streams)))
            tokens += sum(r.json()["usage"]["completion_tokens"] for r in done)
        return tokens / (time.perf_counter() - start)


def run(folder: Path, items: list[EvalItem], *, python: str = sys.executable, log: Path, kv_dtype: str = "auto",
        streams: tuple[int, ...] = (1, 16), max_tokens: int = 48) -> Run:
    start = log.stat().st_size if log.exists() else 0
    with served(folder, python=python, log=log, kv_dtype=kv_dtype) as (url, proc):
        answers = asyncio.run(_answers(url, items, max_tokens))
        tok_s = {s: asyncio.run(_tokens_per_s(url, s)) for s in streams}
        with log.open("rb") as f:
            f.seek(start)
            logged = _KV_LINE.search(f.read().decode(errors="replace"))
        kv_tokens = int(logged.group(1).replace(",", "")) if logged else None
        return Run(folder, kv_dtype, answers, tok_s, pss(proc), kv_tokens)


def compare(a: Path, b: Path, items: list[EvalItem], *, log: Path, python: str = sys.executable,
            kv_dtype_a: str = "auto", kv_dtype_b: str = "auto", streams: tuple[int, ...] = (1, 16)) -> Comparison:
    """A then B, one engine at a time (a box holds one)."""
    first = run(a, items, python=python, log=log, kv_dtype=kv_dtype_a, streams=streams)
    return Comparison(items, first, run(b, items, python=python, log=log, kv_dtype=kv_dtype_b, streams=streams))


def gate(items: list[EvalItem], max_loss: float, *, eval_source: str, log: Path,
         python: str = sys.executable) -> Callable[[Path, Path], dict]:
    """quantize's quality gate: the source and the build answer the eval set (no timing); a build that
    loses more than max_loss is refused, and what was measured goes into its build.json."""
    from quantize.build import BuildError

    def check(source: Path, build: Path) -> dict:
        try:
            result = Comparison(items, run(source, items, python=python, log=log, streams=()),
                                run(build, items, python=python, log=log, streams=()))
        except CompareError as e:
            raise BuildError(f"the quality gate could not run: {e}") from None
        acc_source, acc_build = result.a.accuracy(items), result.b.accuracy(items)
        measured = {"eval": eval_source, "questions": len(items), "accuracy_source": acc_source,
                    "accuracy_build": acc_build, "agreement": result.agreement, "loss": result.loss,
                    "max_loss": max_loss}
        if result.loss > max_loss:
            raise BuildError(f"the build loses {result.loss:.1%} on {eval_source} ({len(items)} questions: "
                             f"{_pct(acc_source)} right unquantized, {_pct(acc_build)} "
                             f"quantized; {result.agreement:.0%} of answers agree), more than --max-loss "
                             f"{max_loss:.1%}: not placed. Try another scheme, more or the site's own calibration "
                             f"data, or raise the bound knowingly")
        return measured

    return check


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"

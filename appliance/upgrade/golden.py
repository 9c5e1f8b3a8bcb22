"""The site's golden set: a few prompts with checks a new model must pass before it takes traffic.

A file of JSON lines, one case each:

    {"prompt": "What is the capital of France?", "expect": ["Paris"], "max_latency_s": 20}
    {"prompt": "Give {\"ok\": true} as JSON only.", "json": true}

`expect`: substrings the answer must hold (any case); `json`: the answer must be a JSON object;
`max_latency_s`: the longest the answer may take; `max_tokens`: its length (16 by default). Every case is
answered greedily by the running model first (before the swap) and by the new one in the gate; the mean
agreement of the two (difflib's word-sequence ratio, 0 to 1) must reach `upgrade.min_agreement`: a model
that loads but answers garbage fails there even where no case has an expectation.
"""

from __future__ import annotations

import difflib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from appliance.engine.args import ENGINE_BASE_URL

PACKAGED = Path(__file__).with_name("golden.jsonl")


class GoldenCase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    expect: list[str] = Field(default_factory=list)
    json_object: bool = Field(default=False, alias="json")
    max_tokens: int = Field(default=16, ge=1, le=1024)
    max_latency_s: float | None = Field(default=None, gt=0)


class GoldenSetError(Exception):
    """A golden set that cannot be read; the message names the file and line."""


def load(path: Path | None) -> list[GoldenCase]:
    path = path or PACKAGED
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise GoldenSetError(f"cannot read the golden set {path}: {e}") from None
    cases = []
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            cases.append(GoldenCase.model_validate_json(line))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "line"
            raise GoldenSetError(f"{path}:{n}: {where}: {first['msg']}") from None
    if not cases:
        raise GoldenSetError(f"the golden set {path} has no cases")
    return cases


@dataclass(frozen=True)
class Answer:
    text: str
    seconds: float


class EngineAsker:
    """Greedy chat answers from one engine, over its private socket with the internal key."""

    def __init__(self, socket_path: Path, key: str, served_name: str, timeout_s: float) -> None:
        self._transport = httpx.AsyncHTTPTransport(uds=str(socket_path), verify=False)
        self._client = httpx.AsyncClient(base_url=ENGINE_BASE_URL, transport=self._transport, timeout=timeout_s,
                                         headers={"Authorization": f"Bearer {key}"})
        self._model = served_name

    async def __aenter__(self) -> EngineAsker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def ask(self, case: GoldenCase) -> Answer:
        started = time.monotonic()
        r = await self._client.post("/v1/chat/completions", json={
            "model": self._model, "messages": [{"role": "user", "content": case.prompt}],
            "temperature": 0, "max_tokens": case.max_tokens})
        r.raise_for_status()
        text = r.json()["choices"][0]["message"].get("content") or ""
        return Answer(text, time.monotonic() - started)


def agreement(a: str, b: str) -> float:
    """How alike two answers are, 0 to 1: difflib's ratio over their words (1 for two empty answers)."""
    return difflib.SequenceMatcher(None, a.split(), b.split(), autojunk=False).ratio()


def case_problems(case: GoldenCase, answer: Answer) -> list[str]:
    out = []
    low = answer.text.lower()
    missing = [e for e in case.expect if e.lower() not in low]
    if missing:
        out.append(f"the answer lacks {missing} ({answer.text[:60]!r})")
    if case.json_object:
        try:
            ok = isinstance(json.loads(answer.text), dict)
        except ValueError:
            ok = False
        if not ok:
            out.append(f"the answer is not a JSON object ({answer.text[:60]!r})")
    if case.max_latency_s is not None and answer.seconds > case.max_latency_s:
        out.append(f"it took {answer.seconds:.1f}s, more than {case.max_latency_s:g}s")
    return out


@dataclass(frozen=True)
class Verdict:
    problems: list[str]  # empty: passed
    agreement: float | None  # mean agreement with the reference answers, when there were some

    @property
    def passed(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        agree = f"agreement {self.agreement:.2f}" if self.agreement is not None else "no reference answers"
        return f"passed ({agree})" if self.passed else f"{'; '.join(self.problems[:5])} ({agree})"


def judge(cases: list[GoldenCase], answers: list[Answer], reference: list[str] | None,
          min_agreement: float) -> Verdict:
    """The gate's verdict on the new model's answers, case by case, then their agreement with the old one's."""
    problems = []
    for n, (case, answer) in enumerate(zip(cases, answers, strict=True), 1):
        problems += [f"case {n} ({case.prompt[:40]!r}): {p}" for p in case_problems(case, answer)]
    mean = None
    if reference is not None:
        mean = sum(agreement(r, a.text) for r, a in zip(reference, answers, strict=True)) / len(answers)
        if mean < min_agreement:
            problems.append(f"its answers agree {mean:.2f} with the running model's, under upgrade.min_agreement "
                            f"{min_agreement:g}")
    return Verdict(problems, mean)

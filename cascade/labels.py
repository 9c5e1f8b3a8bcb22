"""Labels from the ledger: every escalation of a judged local answer that comes back with a regional answer
is an example of whether the local model was right, and the outbox keeps it (issue 34, item 2).

The two answers are compared the ways short-answer evaluations compare them: normalised exact match (case,
punctuation, articles and spacing aside, as SQuAD's evaluation normalises), containment (either one holds
the other: a short answer inside a sentence), token F1, and for answers that choose (a multiple-choice
letter, yes/no, a JSON value) whether they chose the same. `agree` sums them up: the same choice where
both choose, else exact, contained, or F1 of at least AGREE_F1.

Pure: two texts in, an Agreement out; the outbox stores it with the local answer's signals
(cascade.outbox.Outbox.done), the texts only where the site keeps texts.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

AGREE_F1 = 0.5
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
# "B", "(b)", "b)", "Answer: B." at the start of an answer: a multiple-choice letter
_LETTER = re.compile(r"^\s*(?:the\s+)?(?:answer\s*(?:is)?\s*[:\-]?\s*)?\(?([a-e])\)?(?:[.):\s]|$)", re.I)
_YES_NO = re.compile(r"^\s*(yes|no|true|false)\b", re.I)


@dataclass(frozen=True)
class Agreement:
    exact: bool
    contained: bool
    f1: float
    chosen: bool | None  # both answers choose (a letter, yes/no, a JSON value): the same one? None: not both
    agree: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def normalise(text: str) -> str:
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCT))
    return " ".join(text.split())


def _choice(text: str) -> str | None:
    """What an answer chooses, when it chooses: a JSON value, a leading option letter, yes or no."""
    stripped = text.strip()
    if stripped[:1] in "{[":
        try:
            return json.dumps(json.loads(stripped), sort_keys=True)
        except ValueError:
            pass
    for pattern in (_YES_NO, _LETTER):
        m = pattern.match(stripped)
        if m:
            word = m.group(1).lower()
            return {"true": "yes", "false": "no"}.get(word, word)
    return None


def f1(a: str, b: str) -> float:
    ta, tb = normalise(a).split(), normalise(b).split()
    common = sum((Counter(ta) & Counter(tb)).values())
    if not ta or not tb or not common:
        return float(ta == tb)
    precision, recall = common / len(ta), common / len(tb)
    return 2 * precision * recall / (precision + recall)


def agreement(local: str, regional: str) -> Agreement:
    na, nb = normalise(local), normalise(regional)
    exact = na == nb
    contained = bool(na and nb) and (f" {na} " in f" {nb} " or f" {nb} " in f" {na} ")
    score = f1(local, regional)
    ca, cb = _choice(local), _choice(regional)
    chosen = None if ca is None or cb is None else ca == cb
    agree = chosen if chosen is not None else (exact or contained or score >= AGREE_F1)
    return Agreement(exact, contained, round(score, 4), chosen, agree)


def answer_text(body: dict[str, Any] | None) -> str:
    """The text of a whole chat or completion answer (the first choice), "" when it has none."""
    choices = (body or {}).get("choices") or []
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    message = first.get("message") if isinstance(first.get("message"), dict) else {}
    text = message.get("content") if message else first.get("text")
    return text if isinstance(text, str) else ""

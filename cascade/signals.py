"""Confidence signals from the local answer's token log-probabilities (pure functions).

Each signal is higher when the local model is more confident:

* mean_logprob      - average token log-probability. Cheap, but biased by length: long answers
                      average many easy tokens (Gupta et al., "Language model cascades: token-level
                      uncertainty and beyond", ICLR 2024).
* min_logprob       - the least likely token: one confident-looking answer with a single guessed
                      fact scores low.
* quantile_logprob  - a low quantile (default 10th percentile) of token log-probabilities; Gupta et al.
                      found quantiles beat the mean for deferral decisions.
* neg_mean_entropy  - minus the average entropy of the renormalised top-k distribution at each step
                      (0 when the model puts all its top-k mass on one token).
* length            - answer length in tokens (reported, used by the policy only as context).

Inputs come from the OpenAI response shapes vLLM returns: chat `choices[i].logprobs.content[*]`
(`logprob`, `top_logprobs[*].logprob`) and completions `choices[i].logprobs` (`token_logprobs`,
`top_logprobs` as {token: logprob}).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_QUANTILE = 0.1


@dataclass(frozen=True)
class TokenLogprobs:
    """Per generated token: its log-probability and the log-probabilities of the top-k alternatives."""

    logprobs: tuple[float, ...]
    top: tuple[tuple[float, ...], ...]  # per token; may be empty tuples when top-k was not returned


@dataclass(frozen=True)
class Signals:
    mean_logprob: float
    min_logprob: float
    quantile_logprob: float
    neg_mean_entropy: float | None
    length: int

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def mean_logprob(lps: Sequence[float]) -> float:
    return sum(lps) / len(lps)


def min_logprob(lps: Sequence[float]) -> float:
    return min(lps)


def quantile_logprob(lps: Sequence[float], q: float = DEFAULT_QUANTILE) -> float:
    """Linear-interpolated quantile (numpy's default method), without numpy."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1] (got {q})")
    xs = sorted(lps)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def topk_entropy(top: Sequence[float]) -> float:
    """Entropy (nats) of the top-k log-probabilities renormalised to a distribution."""
    m = max(top)
    weights = [math.exp(x - m) for x in top]
    z = sum(weights)
    return -sum((w / z) * math.log(w / z) for w in weights if w > 0)


def neg_mean_entropy(tops: Sequence[Sequence[float]]) -> float | None:
    steps = [t for t in tops if t]
    if not steps:
        return None
    return -sum(topk_entropy(t) for t in steps) / len(steps)


def compute(tl: TokenLogprobs, q: float = DEFAULT_QUANTILE) -> Signals | None:
    """All signals for one answer; None for an empty answer (nothing to judge)."""
    lps = [x for x in tl.logprobs if x is not None and math.isfinite(x)]
    if not lps:
        return None
    return Signals(
        mean_logprob=mean_logprob(lps),
        min_logprob=min_logprob(lps),
        quantile_logprob=quantile_logprob(lps, q),
        neg_mean_entropy=neg_mean_entropy(tl.top),
        length=len(tl.logprobs),
    )


# -- extraction from OpenAI-shaped responses ------------------------------------------------


def _finite(x: Any) -> float:
    # vLLM reports -inf for impossible tokens; keep them comparable rather than dropping them
    v = float(x)
    return v if math.isfinite(v) else -1e9


def from_chat_choice(choice: dict[str, Any]) -> TokenLogprobs:
    content = ((choice.get("logprobs") or {}).get("content")) or []
    return _from_chat_items(content)


def _from_chat_items(items: Iterable[dict[str, Any]]) -> TokenLogprobs:
    lps, tops = [], []
    for item in items:
        lps.append(_finite(item["logprob"]))
        tops.append(tuple(_finite(t["logprob"]) for t in item.get("top_logprobs") or ()))
    return TokenLogprobs(tuple(lps), tuple(tops))


def from_completion_choice(choice: dict[str, Any]) -> TokenLogprobs:
    lp = choice.get("logprobs") or {}
    token_lps = [_finite(x) for x in lp.get("token_logprobs") or [] if x is not None]
    tops = tuple(tuple(_finite(v) for v in (t or {}).values()) for t in lp.get("top_logprobs") or [])
    return TokenLogprobs(tuple(token_lps), tops)


def from_response(body: dict[str, Any]) -> TokenLogprobs:
    """The first choice of a chat or completion response (non-streamed)."""
    choice = (body.get("choices") or [{}])[0]
    if body.get("object") == "chat.completion":
        return from_chat_choice(choice)
    return from_completion_choice(choice)


class StreamAccumulator:
    """Collects token log-probabilities from streamed chunks of either shape, chunk by chunk."""

    def __init__(self) -> None:
        self._lps: list[float] = []
        self._tops: list[tuple[float, ...]] = []

    def add_chunk(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            lp = choice.get("logprobs") or {}
            if "content" in lp:
                part = _from_chat_items(lp.get("content") or [])
            else:
                part = from_completion_choice(choice)
            self._lps.extend(part.logprobs)
            self._tops.extend(part.top)

    def result(self) -> TokenLogprobs:
        return TokenLogprobs(tuple(self._lps), tuple(self._tops))

"""A calibrator learned from the site's own labels (issue 34, item 3): a logistic regression of "the local
answer disagreed with the regional one" on the local answer's signals and cheap request features (the
prompt's and the answer's length, the route, the tenant), fitted on part of the labels the
outbox keeps (cascade.labels) and judged on the rest against the single signal the budget otherwise ranks
by (quantile_logprob). It is used only while it ranks the held-out answers better (AUROC) than that signal.

Why written out rather than scikit-learn's LogisticRegression: six standardised features and at most
MAX_ROWS rows, fitted by Newton's method (iteratively reweighted least squares) with an L2 penalty, is a
few dozen lines of arithmetic; scikit-learn would bring scipy with it (tens of MB) onto every box for them.
The method is the textbook one (Hastie, Tibshirani, Friedman, The Elements of Statistical Learning,
section 4.4.1); the AUROC is the Mann-Whitney statistic, ties counted half.

Pure: labels in, a `Model` (or the reason there is none) out. `Calibrator` holds the model in use and
refits when asked; the cascade asks from a worker thread, so a refit never holds a request.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

FEATURES = ("mean_logprob", "min_logprob", "quantile_logprob", "neg_mean_entropy", "log_length", "no_entropy",
            "log_prompt_chars")
MAX_CATEGORIES = 8  # routes and tenants with a feature of their own (the most frequent; the rest share none)
MAX_ROWS = 5000  # the newest labels a fit reads
MIN_LABELS = 200
HOLD_OUT = 0.3
MARGIN = 0.01  # the calibrator's held-out AUROC must beat the single signal's by this much to be used
L2 = 1.0


def features(signals: dict[str, Any], route: str | None = None, tenant: str | None = None,
             categories: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())) -> list[float]:
    """The signals and cheap request features as the model reads them: an answer without top-k entropy
    says so in its own feature; the prompt's and answer's lengths on a log scale; one indicator per route
    and tenant the model was fitted on."""
    entropy = signals.get("neg_mean_entropy")
    row = [float(signals.get("mean_logprob") or 0.0), float(signals.get("min_logprob") or 0.0),
           float(signals.get("quantile_logprob") or 0.0), float(entropy) if entropy is not None else 0.0,
           math.log1p(max(0, int(signals.get("length") or 0))), 0.0 if entropy is not None else 1.0,
           math.log1p(max(0, int(signals.get("prompt_chars") or 0)))]
    routes, tenants = categories
    return [*row, *(float(route == r) for r in routes), *(float((tenant or "") == t) for t in tenants)]


def _categories(labels: Sequence[dict[str, Any]]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    def most(key: str) -> tuple[str, ...]:
        counts = Counter(str(lb.get(key) or "") for lb in labels)
        return tuple(sorted(name for name, _ in counts.most_common(MAX_CATEGORIES))) if len(counts) > 1 else ()
    return most("route"), most("tenant")


def auroc(positive: Sequence[float], negative: Sequence[float]) -> float:
    """P(a positive's score > a negative's), ties half (Mann-Whitney); nan when either side is empty."""
    if not positive or not negative:
        return float("nan")
    pooled = sorted([(s, 1) for s in positive] + [(s, 0) for s in negative])
    rank_sum, i = 0.0, 0
    while i < len(pooled):
        j = i
        while j < len(pooled) and pooled[j][0] == pooled[i][0]:
            j += 1
        rank_sum += (i + j + 1) / 2 * sum(label for _, label in pooled[i:j])
        i = j
    n1, n0 = len(positive), len(negative)
    return (rank_sum - n1 * (n1 + 1) / 2) / (n1 * n0)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b by Gaussian elimination with partial pivoting (a is small, symmetric positive definite)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def _sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z)) if z >= 0 else math.exp(z) / (1 + math.exp(z))


def fit_logistic(rows: Sequence[Sequence[float]], y: Sequence[int], l2: float = L2, iterations: int = 30) -> list[float]:
    """Weights (bias first) of an L2-penalised logistic regression by Newton's method; rows standardised."""
    d = len(rows[0]) + 1
    x = [[1.0, *r] for r in rows]
    w = [0.0] * d
    for _ in range(iterations):
        p = [_sigmoid(sum(wi * xi for wi, xi in zip(w, xr, strict=True))) for xr in x]
        grad = [sum((p[i] - y[i]) * x[i][j] for i in range(len(x))) + (l2 * w[j] if j else 0.0) for j in range(d)]
        hess = [[sum(p[i] * (1 - p[i]) * x[i][j] * x[i][k] for i in range(len(x))) + (l2 if j == k and j else 0.0)
                 for k in range(d)] for j in range(d)]
        for j in range(d):
            hess[j][j] += 1e-9  # keeps a feature that never varies from making the system singular
        step = _solve(hess, grad)
        w = [wi - si for wi, si in zip(w, step, strict=True)]
        if max(abs(s) for s in step) < 1e-6:
            break
    return w


@dataclass(frozen=True)
class Model:
    version: int
    categories: tuple[tuple[str, ...], tuple[str, ...]]  # the routes and tenants with a feature of their own
    weights: tuple[float, ...]
    means: tuple[float, ...]
    scales: tuple[float, ...]
    trained: int
    held_out: int
    auroc_model: float
    auroc_signal: float
    fitted_at: float = field(default_factory=time.time)

    @property
    def in_use(self) -> bool:
        return self.auroc_model >= self.auroc_signal + MARGIN

    def score(self, signals: dict[str, Any], route: str | None = None, tenant: str | None = None) -> float:
        """P(the local answer disagrees with the regional one): higher is more doubtful."""
        return self.score_row(features(signals, route, tenant, self.categories))

    def score_row(self, row: Sequence[float]) -> float:
        z = [(v - m) / s for v, m, s in zip(row, self.means, self.scales, strict=True)]
        return _sigmoid(self.weights[0] + sum(w * v for w, v in zip(self.weights[1:], z, strict=True)))

    def summary(self) -> dict[str, Any]:
        return {"version": self.version, "in_use": self.in_use, "trained_on": self.trained,
                "held_out": self.held_out, "auroc_calibrator": round(self.auroc_model, 4),
                "auroc_quantile_logprob": round(self.auroc_signal, 4), "fitted_at": self.fitted_at,
                "features": [*FEATURES, *(f"route={r}" for r in self.categories[0]),
                             *(f"tenant={t}" for t in self.categories[1])]}


def fit(labels: Sequence[dict[str, Any]], version: int, seed: int = 0, min_labels: int = MIN_LABELS) -> Model | str:
    """A model from labels ({"signals": {...}, "agree": 0|1}), or why none: too few, or one kind only."""
    labels = [lb for lb in labels[:MAX_ROWS] if isinstance(lb.get("signals"), dict)]
    categories = _categories(labels)
    usable = [(features(lb["signals"], lb.get("route"), lb.get("tenant"), categories), 0 if lb["agree"] else 1)
              for lb in labels]
    if len(usable) < min_labels:
        return f"{len(usable)} labels, {min_labels} needed"
    rng = random.Random(seed)
    rng.shuffle(usable)
    cut = int(len(usable) * (1 - HOLD_OUT))
    train, test = usable[:cut], usable[cut:]
    if len({y for _, y in train}) < 2 or len({y for _, y in test}) < 2:
        return "the labels are all agreements or all disagreements: nothing to learn from"
    cols = list(zip(*(r for r, _ in train), strict=True))
    means = tuple(sum(c) / len(c) for c in cols)
    scales = tuple(math.sqrt(sum((v - m) ** 2 for v in c) / len(c)) or 1.0 for c, m in zip(cols, means, strict=True))

    def z(r: list[float]) -> list[float]:
        return [(v - m) / s for v, m, s in zip(r, means, scales, strict=True)]

    weights = tuple(fit_logistic([z(r) for r, _ in train], [y for _, y in train]))
    model = Model(version, categories, weights, means, scales, len(train), len(test), 0.0, 0.0)
    wrong = [model.score_row(r) for r, y in test if y]
    right = [model.score_row(r) for r, y in test if not y]
    # The single signal ranks the other way round: a lower quantile log-probability is more doubtful.
    quantile = FEATURES.index("quantile_logprob")
    sig_wrong, sig_right = [-r[quantile] for r, y in test if y], [-r[quantile] for r, y in test if not y]
    return Model(version, categories, weights, means, scales, len(train), len(test), auroc(wrong, right),
                 auroc(sig_wrong, sig_right))


class Calibrator:
    """The model in use (only while it beats the single signal) and the last refit's outcome."""

    def __init__(self, min_labels: int = MIN_LABELS) -> None:
        self.min_labels = min_labels
        self.model: Model | None = None  # the last fit, used or not
        self.version = 0
        self.last: str = "not fitted yet"

    @property
    def active(self) -> Model | None:
        return self.model if self.model is not None and self.model.in_use else None

    def refit(self, labels: Sequence[dict[str, Any]]) -> bool:
        """Fit on `labels` (newest first); True when the model in use changed. Blocking: call it from a thread."""
        before = self.active
        result = fit(labels, self.version + 1, min_labels=self.min_labels)
        if isinstance(result, str):
            self.last = result
            log.info("calibrator: not refitted (%s)", result)
            return False
        self.version, self.model = result.version, result
        self.last = (f"version {result.version}: AUROC {result.auroc_model:.3f} against quantile_logprob's "
                     f"{result.auroc_signal:.3f} on {result.held_out} held-out labels; "
                     + ("in use" if result.in_use else "not used (it does not beat the single signal)"))
        log.info("calibrator: %s", self.last)
        return self.active is not before

    def status(self) -> dict[str, Any]:
        return {"last": self.last, "model": self.model.summary() if self.model is not None else None}

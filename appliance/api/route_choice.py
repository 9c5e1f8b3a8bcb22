"""Where one request is answered, decided once: a pure function of the cascade policy's decision, the
engine's readiness, the regional link and the model asked for. The gateway runs one `match` on its answer;
appliance/api/routing.py does the I/O of each way.

| what holds                                              | route                                        |
|---------------------------------------------------------|----------------------------------------------|
| the policy refuses (typed: no endpoint, forbidden)      | Refuse: 404 model_not_found / 403            |
| a model served neither here nor regionally              | Refuse: 404 model_not_found                  |
| escalate now, sync                                      | Regional, the local engine as fallback when  |
|                                                         | it serves the model and is ready             |
| the engine is not ready                                 | Regional when the request may escalate and   |
|                                                         | the link is usable, else Refuse: the engine's|
|                                                         | 503 with Retry-After                         |
| escalate now, async, a model only the region serves     | Regional, no fallback                        |
| escalate now, async                                     | Local, the escalation queued first           |
| local, then judged (auto)                               | Local, judged                                |
| otherwise                                               | Local                                        |

A route the cascade does not speak (the Responses and Messages APIs: `escalable` False) is answered
locally or refused: a policy that would escalate it is a 400 saying so, a model only the region serves a
404, the engine not ready its 503.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.api.errors import ApiError
from cascade.policy import Decision

_REFUSALS = {"no_regional_endpoint": (404, "model_not_found"), "escalation_forbidden": (403, "escalation_forbidden")}


@dataclass(frozen=True)
class Local:
    judge: bool = False  # the auto policy: the answer is judged and escalated when its signals are doubtful
    queue_escalation: bool = False  # async escalation: stored for the forwarder, the local answer served now


@dataclass(frozen=True)
class Regional:
    fallback_local: bool  # the local engine answers when the link cannot deliver


@dataclass(frozen=True)
class Refuse:
    error: ApiError


Route = Local | Regional | Refuse


def choose_route(decision: Decision | None, *, model: str, served_name: str, serves_regionally: bool,
                 engine_refusal: ApiError | None, link_usable: bool, escalable: bool = True) -> Route:
    """decision is None when no regional cluster is configured; engine_refusal is the 503 the engine's
    state gives now (None while it serves); escalable is False on a route the cascade does not speak."""
    if not escalable:
        return _local_only(decision, model, served_name, engine_refusal)
    if decision is not None and decision.action == "refuse":
        status, code = _REFUSALS[decision.refusal or "escalation_forbidden"]
        return Refuse(ApiError(status, f"the model '{model}' cannot be served here: {decision.reason}", code=code,
                               param="model"))
    local_model = model == served_name
    if not local_model and not serves_regionally:
        return Refuse(ApiError(404, f"the model '{model}' does not exist here; this appliance serves "
                                    f"'{served_name}'", code="model_not_found", param="model"))
    escalate_now = decision is not None and decision.action == "escalate_now"
    if escalate_now and decision is not None and decision.mode == "sync":
        return Regional(fallback_local=local_model and engine_refusal is None)
    if engine_refusal is not None:
        # Self-healing: while the engine cannot answer, the regional cluster does when the policy allows.
        if decision is not None and decision.may_escalate and link_usable:
            return Regional(fallback_local=False)
        return Refuse(engine_refusal)
    if escalate_now:
        return Local(queue_escalation=True) if local_model else Regional(fallback_local=False)
    if decision is not None and decision.action == "local_then_judge":
        return Local(judge=True)
    return Local()


def _local_only(decision: Decision | None, model: str, served_name: str, engine_refusal: ApiError | None) -> Route:
    if decision is not None and decision.action == "escalate_now":
        return Refuse(ApiError(400, f"this request would be escalated ({decision.reason}), but escalation to the "
                                    "regional cluster is available on /v1/chat/completions and /v1/completions "
                                    "only; send it there, or without the escalation", code="escalation_unsupported"))
    if model != served_name:
        return Refuse(ApiError(404, f"the model '{model}' does not exist here; this appliance serves "
                                    f"'{served_name}' on this route", code="model_not_found", param="model"))
    if engine_refusal is not None:
        return Refuse(engine_refusal)
    return Local()

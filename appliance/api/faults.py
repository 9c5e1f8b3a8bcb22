"""The last line of defence against the appliance's own bugs: an exception no route handled.

Starlette's handler for ``Exception`` answers and then re-raises, so uvicorn logs the same traceback a
second time and closes the client's keep-alive connection. This outermost middleware ends it instead: one
log record with the traceback, the fault counted in the metrics, and an OpenAI-style 500 on a connection
that stays open (when the response has not started; after that, only the log and the count).

The generation routes record their own faults in the request log first (Gateway.generate); this catches
what is left: the status, doctor, plan, escalation and model routes, and the middleware around them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from appliance.api.errors import ApiError

log = logging.getLogger(__name__)

Scope = dict[str, Any]


def route_label(scope: Scope) -> str:
    """The matched route's template (bounded, unlike the raw path a client chooses), or 'unrouted'."""
    route = scope.get("route")
    return getattr(route, "path", None) or "unrouted"


class FaultBarrier:
    def __init__(self, app: Any, on_fault: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.on_fault = on_fault

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            route = route_label(scope)
            log.exception("%s in the appliance on %s %s", type(e).__name__, scope.get("method"), route)
            if self.on_fault is not None:
                self.on_fault(route)
            if not started:
                error = ApiError(500, "internal error in the appliance; its log has the details", code="internal_error")
                await error.response(scope.get("path", ""))(scope, receive, send)

"""What the gateway is doing right now, request by request.

For the operator whose client says "my request hangs": `GET /v1/appliance/requests` lists every
generation request the gateway holds, in which phase it is (queued for a slot, waiting for the
engine's first answer, streaming), and for a stream how many chunks came from the engine and how many
were handed on to the client, with the time since each last moved. An engine that went silent, a
gateway that stopped relaying and a client that stopped reading look different there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

PHASES = ("admission", "engine", "streaming", "reading", "regional")


@dataclass(eq=False)
class Flight:
    id: str
    route: str
    cls: str
    stream: bool
    started: float = field(default_factory=time.monotonic)
    phase: str = "admission"
    from_engine: int = 0  # chunks read from the engine's answer
    to_client: int = 0  # chunks handed to the server for the client (it took them: not stuck behind a full socket)
    last_from_engine: float | None = None
    last_to_client: float | None = None

    def enter(self, phase: str) -> None:
        assert phase in PHASES, phase
        self.phase = phase

    def received(self) -> None:
        self.from_engine += 1
        self.last_from_engine = time.monotonic()

    def sent(self) -> None:
        self.to_client += 1
        self.last_to_client = time.monotonic()

    def view(self, now: float) -> dict[str, Any]:
        def ago(t: float | None) -> float | None:
            return None if t is None else round(now - t, 3)

        return {"id": self.id, "route": self.route, "class": self.cls, "stream": self.stream,
                "phase": self.phase, "age_s": round(now - self.started, 3),
                "chunks_from_engine": self.from_engine, "chunks_to_client": self.to_client,
                "since_engine_s": ago(self.last_from_engine), "since_client_s": ago(self.last_to_client)}


class InFlight:
    """The requests between their arrival and their entry in the request log, oldest first."""

    def __init__(self) -> None:
        self._flights: dict[int, Flight] = {}

    def start(self, key: object, flight: Flight) -> Flight:
        self._flights[id(key)] = flight
        return flight

    def end(self, key: object) -> None:
        self._flights.pop(id(key), None)

    def snapshot(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [f.view(now) for f in sorted(self._flights.values(), key=lambda f: f.started)]

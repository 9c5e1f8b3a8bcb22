"""Nothing on the event loop waits for the outbox's disk (issue 30): while a writer sits in a slow durable
commit (synchronous=FULL, holding the outbox's lock), /metrics, /healthz and a streamed answer keep their
latency, and the counts they show catch up once the commit is done."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from cascade.outbox import Outbox
from cascade.policy import PolicyConfig
from cascade.service import Cascade
from tests.unit.appliance.api.inprocess import serving

COMMIT_S = 1.5


def _slow_commits(box: Outbox) -> threading.Event:
    """Every transaction of `box` takes COMMIT_S to commit from now on; the event is set once one has begun."""
    atomic, began = box.db.atomic, threading.Event()

    @contextmanager
    def slow():
        with atomic():
            yield
            began.set()
            time.sleep(COMMIT_S)

    box.db.atomic = slow  # type: ignore[method-assign]
    return began


def test_stats_answer_at_once_during_a_slow_commit(tmp_path: Path):
    box = Outbox(tmp_path / "o.db")
    box.put("/v1/chat/completions", {"model": "m"})
    began = _slow_commits(box)
    writer = threading.Thread(target=box.put, args=("/v1/chat/completions", {"model": "m"}))
    writer.start()
    assert began.wait(5)
    t0 = time.monotonic()
    during = box.stats()
    assert time.monotonic() - t0 < 0.1 and during["depth"] == 1  # the last finished write's counts
    writer.join()
    assert box.stats()["depth"] == 2 and box.stats()["counts"]["queued"] == 2


def test_metrics_health_and_a_stream_keep_their_latency_during_a_slow_commit(tmp_path: Path):
    async def events():
        for word in ("a", "b", "c"):
            yield f'data: {{"choices":[{{"index":0,"delta":{{"content":"{word}"}}}}]}}\n\n'.encode()
        yield b"data: [DONE]\n\n"

    box = Outbox(tmp_path / "o.db")
    cascade = Cascade(PolicyConfig(regional_enabled=True, local_model="m"), box, None, None)
    made = serving(tmp_path, lambda r: httpx.Response(200, headers={"content-type": "text/event-stream"},
                                                       content=events()), cascade=cascade)
    began = _slow_commits(box)

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=made.app), base_url="http://t") as c:
            writer = asyncio.create_task(asyncio.to_thread(box.put, "/v1/chat/completions", {"model": "m"}))
            assert await asyncio.to_thread(began.wait, 5)
            took = {}
            for name, call in (
                ("metrics", lambda: c.get("/metrics")),
                ("healthz", lambda: c.get("/healthz")),
                ("stream", lambda: c.post("/v1/chat/completions", json={
                    "model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})),
            ):
                t0 = time.monotonic()
                r = await call()
                took[name] = time.monotonic() - t0
                assert r.status_code == 200, (name, r.text)
                if name == "metrics":
                    assert "appliance_outbox" in r.text
                if name == "stream":
                    assert b"[DONE]" in r.content and json.loads(r.content.split(b"\n")[0][6:])["choices"]
            assert all(t < COMMIT_S / 3 for t in took.values()), f"waited on the commit: {took}"
            assert not writer.done(), "the slow commit ended before the calls: the test proved nothing"
            await writer

    try:
        asyncio.run(scenario())
    finally:
        made.log.close()
    assert box.stats()["depth"] == 1

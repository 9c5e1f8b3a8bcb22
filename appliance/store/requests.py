"""State database (SQLite via sqlite-utils): schema, migrations and the request log.

The request log is written by one background thread fed through a queue, so no
SQLite call (and no fsync) ever runs on the event loop or delays a response.
Rows are queued only after the response has been sent; a crash can lose at most
the rows still in the queue, never a client's answer.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sqlite_utils

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2


@dataclass(slots=True)
class RequestRecord:
    id: str
    ts: float
    route: str
    model: str | None
    status: int
    stream: bool
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    error_code: str | None = None
    key_id: str | None = None
    prompt: str | None = None
    completion: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def open_db(path: Path) -> sqlite_utils.Database:
    # Private to the service user: the database holds key hashes, request metadata and, when kept, prompts.
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists():
        path.touch(mode=0o600)  # created private, rather than made private after the fact
    db = sqlite_utils.Database(path)
    db.enable_wal()
    for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError, PermissionError):  # another user's file: leave it be
            if f.stat().st_mode & 0o077:
                f.chmod(0o600)
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA busy_timeout=5000")
    migrate(db)
    return db


def migrate(db: sqlite_utils.Database) -> None:
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version >= SCHEMA_VERSION:
        return
    with db.conn:
        if version < 1:
            db.table("requests").create(
                {
                    "id": str,
                    "ts": float,
                    "route": str,
                    "model": str,
                    "status": int,
                    "stream": int,
                    "prompt_tokens": int,
                    "completion_tokens": int,
                    "ttft_ms": float,
                    "total_ms": float,
                    "error_code": str,
                    "prompt": str,
                    "completion": str,
                },
                pk="id",
                if_not_exists=True,
            )
            db.table("requests").create_index(["ts"], if_not_exists=True)
        if version < 2:
            db.table("api_keys").create(
                {
                    "id": str,
                    "name": str,
                    "tenant": str,
                    "priority_class": str,
                    "admin": int,
                    "secret_sha256": str,  # the secret itself is never stored
                    "created": float,
                    "revoked": float,
                },
                pk="id",
                if_not_exists=True,
            )
            db.execute("ALTER TABLE requests ADD COLUMN key_id TEXT")
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")


class RequestLog:
    """Asynchronous, batched writer of RequestRecord rows."""

    _STOP = object()
    COALESCE_S = 0.2

    def __init__(self, path: Path, keep_text: bool) -> None:
        self.path = path
        self.keep_text = keep_text
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="request-log", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error:
            raise self._error

    def record(self, rec: RequestRecord) -> None:
        if not self.keep_text:
            rec.prompt = None
            rec.completion = None
        self._q.put(rec)

    def close(self, timeout: float = 5.0) -> None:
        if self._thread.is_alive():
            self._q.put(self._STOP)
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            db = open_db(self.path)
        except BaseException as e:  # reported to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        table = db.table("requests")
        stop = False
        while not stop:
            batch = [self._q.get()]
            # Let a busy gateway's rows gather first: one wake-up and one transaction per interval, not
            # one per request (each wake-up takes the GIL from the event loop). The STOP marker skips it.
            if batch[0] is not self._STOP:
                time.sleep(self.COALESCE_S)
            while True:  # drain what is already queued into one transaction
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            rows = []
            for item in batch:
                if item is self._STOP:
                    stop = True
                    continue
                rows.append(_row(item))
            if rows:
                _write(db, table, rows)
        db.close()


def _row(rec: RequestRecord) -> dict[str, Any]:
    row = asdict(rec)
    row.pop("extra")
    row["stream"] = int(row["stream"])
    # Text SQLite can store: a client's lone surrogate ("\ud800" is valid JSON) fails the insert
    # with UnicodeEncodeError otherwise.
    return {k: _storable(v) if isinstance(v, str) else v for k, v in row.items()}


def _storable(text: str) -> str:
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def _write(db: sqlite_utils.Database, table: Any, rows: list[dict[str, Any]]) -> None:
    """One transaction for the batch; if it fails, row by row, so one bad row costs only itself."""
    try:
        with db.atomic():
            table.insert_all(rows, replace=True)
        return
    except Exception as e:  # any error: what follows isolates the row that caused it
        if len(rows) == 1:
            log.error("could not write request-log row %s: %s: %s", rows[0].get("id"), type(e).__name__, e)
            return
    for row in rows:
        _write(db, table, [row])


def recent_requests(path: Path, limit: int = 50) -> list[dict[str, Any]]:
    db = open_db(path)
    try:
        return list(db["requests"].rows_where(order_by="ts desc", limit=limit))
    finally:
        db.close()


def recent_errors(path: Path, limit: int = 10) -> list[dict[str, Any]]:
    """The newest answers that were not a success (status 400 and over), for the status page: when,
    which route, which status and error code. Never the prompt or the answer."""
    db = open_db(path)
    try:
        return list(db["requests"].rows_where("status >= 400", order_by="ts desc", limit=limit,
                                              select="id, ts, route, status, error_code, key_id"))
    finally:
        db.close()

"""The escalation outbox: SQLite in WAL mode, written before the client gets its answer.

Every escalation, sent at once or later, is a row here, so its regional answer can be fetched by id
and nothing is lost when the link or the process dies.

    queued  --claim-->  sending  --done-->    done
      ^                    |  --rejected-->  failed   (the regional side refused it: no resend)
      |                    |  --gave up-->   failed   (max_attempts answered errors)
      +----- link down ----+
      +----- restart (a crash between the send and the commit) --+
    queued --older than max_age--> expired

The guarantee is at-least-once delivery with an idempotency key (the escalation id): a row in `sending`
when the process died is sent again after the restart with the same key, and the regional side drops the
duplicate. Once a row is `done` it is never sent again.

Synchronous on purpose (plain SQLite, easy to test); the service calls it from a worker thread.
`synchronous=FULL`: a row written here survives power loss, not only a crash of the process.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import sqlite_utils

from cascade.labels import agreement, answer_text
from cascade.policy import PRIORITY_CLASSES

Status = Literal["queued", "sending", "done", "failed", "expired"]
STATUSES: tuple[Status, ...] = get_args(Status)
PRIORITY: dict[str, int] = {cls: rank for rank, cls in enumerate(PRIORITY_CLASSES)}  # unknown: silver's
PENDING: tuple[Status, ...] = ("queued", "sending")
FINISHED: tuple[Status, ...] = tuple(s for s in STATUSES if s not in PENDING)


class OutboxFull(Exception):
    pass


@dataclass(frozen=True)
class Escalation:
    id: str
    created: float
    status: Status
    route: str
    request: dict[str, Any]
    priority: int = 1
    tenant: str | None = None
    key_id: str | None = None
    reason: str = ""
    attempts: int = 0
    next_attempt: float = 0.0
    last_error: str | None = None
    answer: dict[str, Any] | None = None
    delivered: float | None = None
    sends: int = 0  # times it went over the link (a resend after a crash counts)

    @property
    def priority_class(self) -> str:
        return PRIORITY_CLASSES[self.priority] if 0 <= self.priority < len(PRIORITY_CLASSES) else "silver"

    def summary(self) -> dict[str, Any]:
        """Without the request and the answer: what lists and logs may show."""
        return {"id": self.id, "created": self.created, "status": self.status, "route": self.route,
                "priority": self.priority, "tenant": self.tenant, "key_id": self.key_id, "reason": self.reason,
                "attempts": self.attempts, "sends": self.sends, "last_error": self.last_error,
                "delivered": self.delivered}


def new_id() -> str:
    return f"esc-{uuid.uuid4().hex}"


def _row(r: dict[str, Any]) -> Escalation:
    return Escalation(
        id=r["id"], created=r["created"], status=r["status"], route=r["route"], request=json.loads(r["request"]),
        priority=r["priority"], tenant=r["tenant"], key_id=r["key_id"], reason=r["reason"] or "",
        attempts=r["attempts"], next_attempt=r["next_attempt"], last_error=r["last_error"],
        answer=json.loads(r["answer"]) if r["answer"] else None, delivered=r["delivered"], sends=r["sends"],
    )


LABELS_MAX_ROWS = 100_000
LABELS_MAX_AGE_S = 90 * 86400.0


class Outbox:
    def __init__(self, path: Path, max_pending: int = 50_000, max_age_s: float = 7 * 86400,
                 clock=time.time, keep_label_text: bool = False, labels_max_rows: int = LABELS_MAX_ROWS,
                 labels_max_age_s: float = LABELS_MAX_AGE_S, webhook_tenants: Iterable[str | None] = ()) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, check_same_thread=False, timeout=10, isolation_level=None)
        self.db = sqlite_utils.Database(conn)
        self.db.enable_wal()
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA busy_timeout=10000")
        self._lock = threading.Lock()  # one connection shared by worker threads
        self.max_pending = max_pending
        self.max_age_s = max_age_s
        self.clock = clock
        # Labels (cascade.labels): their texts only where the site keeps texts (state.log_prompts); the
        # signals and the agreement always. Bounded in rows and age.
        self.keep_label_text = keep_label_text
        self.labels_max_rows, self.labels_max_age_s = labels_max_rows, labels_max_age_s
        # Tenants whose client is told when an escalation's regional answer arrives (cascade.webhooks);
        # None stands for every tenant without one of its own.
        self.webhook_tenants = frozenset(webhook_tenants)
        self._create()
        # What stats() serves: replaced whole after every write here, read without the lock. Writes by
        # another process (`appliance escalations retry`) show after the next write here; the forwarder
        # expires old rows on every poll, so that is within regional.forward_poll_s.
        self._snapshot: tuple[dict[str, int], float | None] = self._count()

    def _create(self) -> None:
        t = self.db.table("escalations")
        if not t.exists():
            t.create({"id": str, "created": float, "status": str, "route": str, "request": str, "priority": int,
                      "tenant": str, "key_id": str, "reason": str, "attempts": int, "next_attempt": float,
                      "last_error": str, "answer": str, "delivered": float, "sends": int}, pk="id")
            t.create_index(["status", "priority", "created"])
        # The judged local answer an escalation was made from, until its regional answer labels it (an
        # outbox from before labels gains the columns).
        for column in ("local_answer", "local_signals"):
            if column not in t.columns_dict:
                t.add_column(column, str)
        labels = self.db.table("labels")
        if not labels.exists():
            labels.create({"esc_id": str, "ts": float, "route": str, "tenant": str, "signals": str, "exact": int,
                           "contained": int, "f1": float, "chosen": int, "agree": int, "local_answer": str,
                           "regional_answer": str}, pk="esc_id")
            labels.create_index(["ts"])
        hooks = self.db.table("webhooks")
        if not hooks.exists():
            hooks.create({"esc_id": str, "tenant": str, "status": str, "created": float, "attempts": int,
                          "next_attempt": float, "last_error": str, "delivered": float, "sends": int}, pk="esc_id")
            hooks.create_index(["status", "next_attempt"])

    def close(self) -> None:
        self.db.conn.close()

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """One write: a durable transaction, then the counts stats() serves, both under the lock (in the
        writer's worker thread: the event loop never waits on this lock or an fsync)."""
        with self._lock:
            with self.db.atomic():
                yield
            self._snapshot = self._count()

    def _count(self) -> tuple[dict[str, int], float | None]:
        counts = dict(self.db.execute("SELECT status, count(*) FROM escalations GROUP BY status").fetchall())
        oldest = self.db.execute("SELECT min(created) FROM escalations WHERE status IN ('queued','sending')"
                                 ).fetchone()[0]
        return counts, oldest

    # -- writing --------------------------------------------------------------------------------

    def put(self, route: str, request: dict[str, Any], *, priority_class: str = "silver", tenant: str | None = None,
            key_id: str | None = None, reason: str = "", local_answer: str | None = None,
            local_signals: dict[str, Any] | None = None) -> Escalation:
        """Store a new escalation durably; OutboxFull when max_pending are already waiting. A judged local
        answer (its text and signals) is kept with it until the regional answer labels it."""
        now = self.clock()
        row = {"id": new_id(), "created": now, "status": "queued", "route": route,
               "request": json.dumps(request), "priority": PRIORITY.get(priority_class, 1), "tenant": tenant,
               "key_id": key_id, "reason": reason, "attempts": 0, "next_attempt": now, "last_error": None,
               "answer": None, "delivered": None, "sends": 0,
               "local_answer": local_answer if local_signals is not None else None,
               "local_signals": json.dumps(local_signals) if local_signals is not None else None}
        with self._writing():
            if self._pending() >= self.max_pending:
                raise OutboxFull(f"the escalation outbox holds {self.max_pending} waiting escalations "
                                 "(policy.outbox_max_pending)")
            self.db.table("escalations").insert(row)
        return _row(row)

    def claim(self, limit: int) -> list[Escalation]:
        """Take up to `limit` due rows, gold before silver before bronze, oldest first; mark them sending."""
        now = self.clock()
        with self._writing():
            rows = list(self.db.query(
                "UPDATE escalations SET status='sending', sends=sends+1 WHERE id IN ("
                " SELECT id FROM escalations WHERE status='queued' AND next_attempt<=?"
                " ORDER BY priority, created LIMIT ?) RETURNING *", [now, limit]))
        return sorted((_row(r) for r in rows), key=lambda e: (e.priority, e.created))

    def mark_sending(self, esc_id: str) -> None:
        """The request path sends at once (sync mode): the row is written first, then marked, then sent."""
        with self._writing():
            self.db.execute("UPDATE escalations SET status='sending', sends=sends+1 WHERE id=?", [esc_id])

    def done(self, esc_id: str, answer: dict[str, Any]) -> None:
        """Delivered: the answer kept, and when the escalation came from a judged local answer, the two
        compared and the label written in the same transaction (whichever path delivered it)."""
        with self._writing():
            changed = self.db.execute("UPDATE escalations SET status='done', answer=?, delivered=?, last_error=NULL "
                                      "WHERE id=? AND status!='done'", [json.dumps(answer), self.clock(), esc_id])
            if changed.rowcount:
                self._label(esc_id, answer)
                self._queue_webhook(esc_id)

    def _label(self, esc_id: str, answer: dict[str, Any]) -> None:
        row = self.db.execute("SELECT route, tenant, local_answer, local_signals FROM escalations WHERE id=?",
                              [esc_id]).fetchone()
        if row is None or row[3] is None:
            return
        route, tenant, local, signals = row
        regional = answer_text(answer)
        a = agreement(local or "", regional)
        keep = self.keep_label_text
        self.db.table("labels").insert({
            "esc_id": esc_id, "ts": self.clock(), "route": route, "tenant": tenant, "signals": signals,
            "exact": int(a.exact), "contained": int(a.contained), "f1": a.f1,
            "chosen": None if a.chosen is None else int(a.chosen), "agree": int(a.agree),
            "local_answer": local if keep else None, "regional_answer": regional if keep else None}, replace=True)
        # The local text served its purpose: it leaves the escalation row with the label written.
        self.db.execute("UPDATE escalations SET local_answer=NULL WHERE id=?", [esc_id])
        self.db.execute("DELETE FROM labels WHERE ts<?", [self.clock() - self.labels_max_age_s])
        self.db.execute("DELETE FROM labels WHERE esc_id IN (SELECT esc_id FROM labels ORDER BY ts DESC "
                        "LIMIT -1 OFFSET ?)", [self.labels_max_rows])

    def _queue_webhook(self, esc_id: str) -> None:
        """In done's transaction: the client's webhook is owed a call, durably, like the escalation was."""
        if not self.webhook_tenants:
            return
        tenant, reason = self.db.execute("SELECT tenant, reason FROM escalations WHERE id=?", [esc_id]).fetchone()
        if (reason or "").startswith("shadow"):  # sent for a label only: the client kept its answer
            return
        if tenant in self.webhook_tenants or None in self.webhook_tenants:
            now = self.clock()
            self.db.execute("INSERT OR IGNORE INTO webhooks (esc_id, tenant, status, created, attempts, next_attempt, "
                            "sends) VALUES (?, ?, 'queued', ?, 0, ?, 0)", [esc_id, tenant, now, now])

    def claim_webhooks(self, limit: int) -> list[dict[str, Any]]:
        """Due webhook calls, oldest first, marked sending: each with its escalation's answer and label."""
        now = self.clock()
        with self._writing():
            ids = [r[0] for r in self.db.execute(
                "UPDATE webhooks SET status='sending', sends=sends+1 WHERE esc_id IN (SELECT esc_id FROM webhooks "
                "WHERE status='queued' AND next_attempt<=? ORDER BY created LIMIT ?) RETURNING esc_id",
                [now, limit]).fetchall()]
        return [self.webhook_payload(i) for i in ids]

    def webhook_payload(self, esc_id: str) -> dict[str, Any]:
        with self._lock:
            hook = next(self.db.query("SELECT * FROM webhooks WHERE esc_id=?", [esc_id]))
            esc = next(self.db.query("SELECT id, created, delivered, answer, tenant, key_id FROM escalations "
                                     "WHERE id=?", [esc_id]))
        return {**hook, "body": {"id": esc["id"], "object": "appliance.escalation", "status": "done",
                                 "created": esc["created"], "delivered": esc["delivered"],
                                 "answer": json.loads(esc["answer"]) if esc["answer"] else None,
                                 "agreement": self.label(esc_id)}}

    def webhook_sent(self, esc_id: str) -> None:
        with self._writing():
            self.db.execute("UPDATE webhooks SET status='done', delivered=?, last_error=NULL WHERE esc_id=?",
                            [self.clock(), esc_id])

    def webhook_failed(self, esc_id: str, error: str, retry_in_s: float | None, counts: bool = True) -> None:
        """Back to the queue after retry_in_s, or failed for good (None: the receiver refused it). A call
        that never reached the receiver (counts False) spends no attempt, as an escalation's does not."""
        with self._writing():
            if retry_in_s is None:
                self.db.execute("UPDATE webhooks SET status='failed', attempts=attempts+1, last_error=? "
                                "WHERE esc_id=?", [error[:500], esc_id])
            else:
                self.db.execute("UPDATE webhooks SET status='queued', attempts=attempts+?, last_error=?, "
                                "next_attempt=? WHERE esc_id=?",
                                [int(counts), error[:500], self.clock() + retry_in_s, esc_id])

    def recover_webhooks(self) -> int:
        with self._writing():
            return self.db.execute("UPDATE webhooks SET status='queued' WHERE status='sending'").rowcount

    def label(self, esc_id: str) -> dict[str, Any] | None:
        """An escalation's label (the agreement of its regional answer with the local one), if it has one."""
        with self._lock:
            rows = list(self.db.query("SELECT agree, exact, contained, f1, chosen FROM labels WHERE esc_id=?",
                                      [esc_id]))
        if not rows:
            return None
        r = rows[0]
        return {"agree": bool(r["agree"]), "exact": bool(r["exact"]), "contained": bool(r["contained"]),
                "f1": r["f1"], "chosen": None if r["chosen"] is None else bool(r["chosen"])}

    def labels(self, limit: int = 1000) -> list[dict[str, Any]]:
        """The newest labels: route, tenant, the local answer's signals, the agreement (texts where kept)."""
        with self._lock:
            rows = list(self.db.query("SELECT * FROM labels ORDER BY ts DESC LIMIT ?", [limit]))
        return [{**r, "signals": json.loads(r["signals"])} for r in rows]

    def release(self, esc_id: str, error: str, retry_in_s: float = 0.0, counts: bool = False,
                max_attempts: int | None = None) -> Status:
        """Back to the queue after a failed send (or to failed once max_attempts answered errors)."""
        with self._writing():
            r = self.db.execute("SELECT attempts FROM escalations WHERE id=?", [esc_id]).fetchone()
            if r is None:
                return "failed"
            attempts = r[0] + (1 if counts else 0)
            status: Status = "failed" if max_attempts is not None and attempts >= max_attempts else "queued"
            self.db.execute("UPDATE escalations SET status=?, attempts=?, last_error=?, next_attempt=? "
                            "WHERE id=? AND status='sending'",
                            [status, attempts, error[:500], self.clock() + retry_in_s, esc_id])
        return status

    def fail(self, esc_id: str, error: str) -> None:
        with self._writing():
            self.db.execute("UPDATE escalations SET status='failed', attempts=attempts+1, last_error=? WHERE id=?",
                            [error[:500], esc_id])

    def recover(self) -> int:
        """At start: rows left in `sending` by a crash go back to the queue (their key makes a resend safe)."""
        with self._writing():
            return self.db.execute("UPDATE escalations SET status='queued' WHERE status='sending'").rowcount

    def expire(self) -> int:
        cutoff = self.clock() - self.max_age_s
        with self._writing():
            return self.db.execute("UPDATE escalations SET status='expired', last_error='older than "
                                   "policy.outbox_max_age_s' WHERE status='queued' AND created<?", [cutoff]).rowcount

    def retry(self, ids: Iterable[str] | None = None) -> int:
        """Failed or expired rows back to the queue: the given ids, or all of them."""
        with self._writing():
            if ids is None:
                sql, args = "status IN ('failed','expired')", []
            else:
                ids = list(ids)
                sql = f"status IN ('failed','expired') AND id IN ({','.join('?' * len(ids))})"
                args = ids
            return self.db.execute(f"UPDATE escalations SET status='queued', attempts=0, next_attempt=? "
                                   f"WHERE {sql}", [self.clock(), *args]).rowcount

    def purge(self, statuses: Iterable[str] = FINISHED, older_than_s: float = 0.0,
              ids: Iterable[str] | None = None) -> int:
        """Delete finished rows; pending ones (queued, sending) are never purged."""
        statuses = [s for s in statuses if s not in PENDING]
        if not statuses:
            return 0
        where = f"status IN ({','.join('?' * len(statuses))}) AND created<=?"
        args: list[Any] = [*statuses, self.clock() - older_than_s]
        if ids is not None:
            ids = list(ids)
            where += f" AND id IN ({','.join('?' * len(ids))})"
            args += ids
        with self._writing():
            return self.db.execute(f"DELETE FROM escalations WHERE {where}", args).rowcount

    # -- reading --------------------------------------------------------------------------------

    def get(self, esc_id: str) -> Escalation | None:
        with self._lock:
            rows = list(self.db.query("SELECT * FROM escalations WHERE id=?", [esc_id]))
        return _row(rows[0]) if rows else None

    def list(self, status: str | None = None, key_id: str | None = None, limit: int = 50) -> list[Escalation]:
        where, args = [], []
        if status:
            where.append("status=?")
            args.append(status)
        if key_id:
            where.append("key_id=?")
            args.append(key_id)
        sql = "SELECT * FROM escalations" + (" WHERE " + " AND ".join(where) if where else "")
        with self._lock:
            rows = list(self.db.query(sql + " ORDER BY created DESC LIMIT ?", [*args, limit]))
        return [_row(r) for r in rows]

    def _pending(self) -> int:
        return self.db.execute("SELECT count(*) FROM escalations WHERE status IN ('queued','sending')").fetchone()[0]

    def stats(self) -> dict[str, Any]:
        """Counts by status, depth and the oldest pending age, as of this process's last write: no lock and
        no query, so /metrics and the status page never wait on a commit."""
        counts, oldest = self._snapshot
        return {"counts": {s: counts.get(s, 0) for s in STATUSES},
                "depth": counts.get("queued", 0) + counts.get("sending", 0),
                "oldest_age_s": self.clock() - oldest if oldest is not None else 0.0,
                "max_pending": self.max_pending}

"""The request log: no request can take other requests' rows with it (issue: a lone surrogate in one
request's model name failed the batch insert and lost every row queued beside it)."""

from __future__ import annotations

import time

from appliance.store.requests import RequestLog, RequestRecord, recent_requests


def _rec(i: int, model: str = "m", prompt_tokens: int | None = 3) -> RequestRecord:
    return RequestRecord(id=f"req-{i}", ts=time.time(), route="/v1/chat/completions", model=model, status=200,
                         stream=False, prompt_tokens=prompt_tokens)


def _written(tmp_path, records: list[RequestRecord]) -> dict[str, dict]:
    log = RequestLog(tmp_path / "state.db", keep_text=True)
    log.start()
    for r in records:
        log.record(r)  # all queued before the writer wakes: one batch
    log.close()
    return {row["id"]: row for row in recent_requests(tmp_path / "state.db", limit=100)}


def test_a_lone_surrogate_is_stored_replaced_and_loses_no_neighbour(tmp_path):
    good = [_rec(i) for i in range(12)]
    poisoned = _rec(99, model="\ud800")
    poisoned.prompt = "hi \udfff there"
    rows = _written(tmp_path, [*good[:6], poisoned, *good[6:]])
    assert set(rows) == {r.id for r in good} | {"req-99"}
    assert rows["req-99"]["model"] == "?" and rows["req-99"]["prompt"] == "hi ? there"


def test_a_row_sqlite_refuses_costs_only_itself(tmp_path):
    good = [_rec(i) for i in range(12)]
    unstorable = _rec(98, prompt_tokens=2**70)  # past SQLite's 64-bit integers: OverflowError
    rows = _written(tmp_path, [*good[:6], unstorable, *good[6:]])
    assert set(rows) == {r.id for r in good}


def test_the_state_database_is_private_to_the_service(tmp_path):
    """Issue 15: the database was created world-readable."""
    import os
    import stat

    from appliance.store.requests import open_db

    path = tmp_path / "new-state" / "appliance.db"
    umask = os.umask(0o022)  # a usual default: what the daemon must not rely on
    try:
        open_db(path).close()
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    for f in path.parent.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    path.chmod(0o644)  # an older install's database
    open_db(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

"""The cascade's I/O parts without servers: breaker, outbox, token file, answer shaping, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance.api import answers
from appliance.cli import main
from cascade.breaker import CircuitBreaker
from cascade.outbox import Outbox, OutboxFull
from cascade.regional import TokenFileError, read_token


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_after_failures_probes_once_and_backs_off():
    clock = Clock()
    b = CircuitBreaker(failures=2, reset_s=10, max_reset_s=25, clock=clock)
    b.failure()
    assert b.state == "closed" and b.allow()
    b.failure()
    assert b.state == "open" and not b.allow() and b.retry_in_s == 10
    clock.t += 10
    assert b.allow() and b.state == "half_open"
    assert not b.allow()  # one probe at a time
    b.failure()
    assert b.state == "open" and b.retry_in_s == 20  # the wait doubled
    clock.t += 20
    assert b.allow()
    b.failure()
    assert b.retry_in_s == 25  # capped
    clock.t += 25
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.allow()


def test_outbox_orders_by_priority_then_age_and_bounds_pending(tmp_path: Path):
    clock = Clock()
    box = Outbox(tmp_path / "o.db", max_pending=3, clock=clock)
    for cls in ("bronze", "silver", "gold"):
        box.put("/v1/chat/completions", {"cls": cls}, priority_class=cls)
        clock.t += 1
    with pytest.raises(OutboxFull, match="3 waiting"):
        box.put("/v1/chat/completions", {}, priority_class="gold")
    claimed = box.claim(2)
    assert [e.request["cls"] for e in claimed] == ["gold", "silver"] and all(e.sends == 1 for e in claimed)
    box.done(claimed[0].id, {"choices": [1]})
    assert box.stats()["depth"] == 2  # done rows free room
    box.put("/v1/chat/completions", {"cls": "new"})
    assert box.get(claimed[0].id).answer == {"choices": [1]}


def test_outbox_recovers_rows_caught_mid_send_and_never_resends_done(tmp_path: Path):
    box = Outbox(tmp_path / "o.db")
    a = box.put("/r", {"n": 1})
    b = box.put("/r", {"n": 2})
    box.claim(2)
    box.done(a.id, {"ok": True})
    box.close()  # a crash: b was on the wire
    again = Outbox(tmp_path / "o.db")
    assert again.recover() == 1
    resent = again.claim(10)
    assert [e.id for e in resent] == [b.id] and resent[0].sends == 2
    assert again.get(a.id).status == "done"


def test_outbox_retry_backoff_give_up_expire_and_purge(tmp_path: Path):
    clock = Clock()
    box = Outbox(tmp_path / "o.db", max_age_s=100, clock=clock)
    e = box.put("/r", {})
    box.claim(1)
    assert box.release(e.id, "500", retry_in_s=30, counts=True, max_attempts=2) == "queued"
    assert box.claim(1) == []  # not due yet
    clock.t += 30
    box.claim(1)
    assert box.release(e.id, "500", counts=True, max_attempts=2) == "failed"
    assert box.retry([e.id]) == 1 and box.get(e.id).status == "queued"
    old = box.put("/r", {})
    clock.t += 101
    assert box.expire() == 2 and box.get(old.id).status == "expired"
    assert box.purge(("expired",)) == 2 and box.get(old.id) is None
    assert box.purge(("queued", "sending")) == 0  # waiting rows are never purged


def test_token_file_must_be_private_and_non_empty(tmp_path: Path):
    tf = tmp_path / "token"
    tf.write_text("secret\n")
    tf.chmod(0o644)
    with pytest.raises(TokenFileError, match="chmod 600"):
        read_token(tf)
    tf.chmod(0o600)
    assert read_token(tf) == "secret"
    tf.write_text("  ")
    with pytest.raises(TokenFileError, match="empty"):
        read_token(tf)
    with pytest.raises(TokenFileError, match="cannot read"):
        read_token(tmp_path / "missing")


def test_logprobs_requested_for_the_judge_and_hidden_again():
    chat = {"messages": []}
    assert answers.request_logprobs(chat, chat=True) is False
    assert chat["logprobs"] is True and chat["top_logprobs"] == answers.TOP_K
    comp = {"logprobs": 2}
    assert answers.request_logprobs(comp, chat=False) is True and comp["logprobs"] == answers.TOP_K
    data = {"choices": [{"logprobs": {"content": []}, "message": {}}]}
    answers.hide_logprobs(data)
    assert data["choices"][0]["logprobs"] is None


def test_a_whole_answer_replayed_as_a_stream():
    answer = {"id": "x", "object": "chat.completion", "created": 1, "model": "big",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    raw = answers.as_stream(answer, include_usage=True).decode()
    events = [e[6:] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Paris."}
    assert chunks[1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["usage"]["total_tokens"] == 5
    assert "usage" not in answers.as_stream(answer, include_usage=False).decode()


def test_escalations_cli(tmp_path: Path):
    cfg = tmp_path / "appliance.toml"
    cfg.write_text(f'[model]\npath = "{tmp_path}"\n[state]\ndirectory = "{tmp_path / "state"}"\n')
    box = Outbox(tmp_path / "state" / "outbox.db")
    e = box.put("/v1/chat/completions", {"messages": [{"role": "user", "content": "top secret"}]}, reason="always")
    box.claim(1)
    box.fail(e.id, "400 from regional")
    run = CliRunner().invoke
    listed = run(main, ["escalations", "list", "--config", str(cfg)])
    assert listed.exit_code == 0 and e.id in listed.output and "top secret" not in listed.output
    shown = run(main, ["escalations", "show", "--config", str(cfg), e.id])
    assert shown.exit_code == 0 and json.loads(shown.output)["request"]["messages"][0]["content"] == "top secret"
    assert run(main, ["escalations", "show", "--config", str(cfg), "esc-nope"]).exit_code == 1
    assert run(main, ["escalations", "retry", "--config", str(cfg)]).exit_code == 2
    retried = run(main, ["escalations", "retry", "--config", str(cfg), e.id])
    assert retried.exit_code == 0 and "queued 1" in retried.output and box.get(e.id).status == "queued"
    box.claim(1)
    box.done(e.id, {"choices": []})
    purged = run(main, ["escalations", "purge", "--config", str(cfg)])
    assert "purged 1" in purged.output and box.get(e.id) is None

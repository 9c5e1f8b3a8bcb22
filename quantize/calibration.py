"""Calibration conversations for the schemes that need them (GPTQ reads each layer's inputs on these).

The project ships a small varied set (calibration.jsonl: questions, instructions, code, arithmetic, JSON,
short multi-turn chats). A site that keeps prompts (`state.log_prompts`) may calibrate on its own traffic
instead, opt-in: what its users ask is what the build must answer well. Either way the worker gets one
{"messages": [...]} (rendered with the model's chat template) or {"text": ...} (sent as is) per line.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from quantize.jsonl import numbered_lines

SHIPPED = Path(__file__).with_name("calibration.jsonl")
_CHAT, _COMPLETIONS = "/v1/chat/completions", "/v1/completions"


class CalibrationError(ValueError):
    """No usable calibration data; the message says where it looked."""


@dataclass(frozen=True)
class Calibration:
    items: tuple[dict, ...]
    source: str  # "shipped", or the request log's path

    def jsonl(self) -> str:
        """What the worker reads (one item per line); its sha256 goes into build.json."""
        return "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in self.items)


def shipped() -> Calibration:
    items = tuple(json.loads(line) for line in SHIPPED.read_text().splitlines() if line.strip())
    return Calibration(items, "shipped")


def from_request_log(db: Path, limit: int) -> Calibration:
    """The newest chat and completions prompts the site's request log kept, text-only messages."""
    if not db.is_file():
        raise CalibrationError(f"no request log at {db}")
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT route, prompt FROM requests WHERE prompt IS NOT NULL AND route IN (?, ?) "
                            "AND status = 200 ORDER BY ts DESC LIMIT ?", (_CHAT, _COMPLETIONS, limit * 4)).fetchall()
    items = [item for route, prompt in rows if (item := _item(route, prompt)) is not None][:limit]
    if not items:
        raise CalibrationError(f"the request log {db} holds no kept chat or completions prompts (prompts are kept "
                               "only with state.log_prompts = true); calibrate on the shipped set instead")
    return Calibration(tuple(items), str(db))


def _item(route: str, prompt: str) -> dict | None:
    if route == _COMPLETIONS:
        return {"text": prompt} if prompt.strip() else None
    try:
        messages = json.loads(prompt)
    except ValueError:
        return None
    if not isinstance(messages, list) or not messages:
        return None
    kept = [{"role": m["role"], "content": m["content"]} for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in
            ("system", "user", "assistant")]
    return {"messages": kept} if kept and kept[-1]["role"] != "system" else None


def from_file(path: Path) -> Calibration:
    items = []
    for n, item in numbered_lines(path, CalibrationError):
        if not (isinstance(item, dict) and (isinstance(item.get("text"), str) or _is_messages(item.get("messages")))):
            raise CalibrationError(f'{path}:{n}: each line must be {{"messages": [{{"role", "content"}}, ...]}} '
                                   'or {"text": "..."}')
        items.append(item)
    if not items:
        raise CalibrationError(f"{path} holds no calibration conversations")
    return Calibration(tuple(items), str(path))


def _is_messages(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)

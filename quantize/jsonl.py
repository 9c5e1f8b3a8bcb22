"""Reading the JSON-lines files quantize takes (calibration conversations, eval questions)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def numbered_lines(path: Path, error: type[Exception]) -> Iterator[tuple[int, Any]]:
    """Each non-blank line's number (from 1) and its parsed JSON; a line that is not JSON raises error,
    naming the file and the line."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except ValueError as e:
            raise error(f"{path}:{n}: not JSON ({e})") from None

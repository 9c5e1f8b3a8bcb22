"""What the box runs, as committed: the current version and the one before it, and the journal of an upgrade
in progress. Both are small JSON files in the state directory, each replaced whole (written beside, synced,
renamed), so a daemon killed at any instant finds either the old file or the new one, never half of either.

How the configuration file and the box's own upgrades share the say:
  * the file names a version (model.path, model.digest, engine.python, kernels.lock);
  * `appliance upgrade` commits another one on the box; the daemon serves the committed version from then on;
  * the history remembers the file's version it started from (`base`): when the file is changed afterwards
    (the fleet pushed a new configuration), the file wins and the box's history is set aside.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from appliance.boot.config import Config

VERSIONS_FILE = "versions.json"
JOURNAL_FILE = "upgrade-journal.json"


@dataclass(frozen=True)
class Version:
    """One model and engine the box can run, with their pins."""

    model_path: str
    model_digest: str  # the pin, sha256:...; "" when the configuration pins by the folder's manifest only
    served_name: str  # kept across an upgrade: the id clients send does not change with the build
    engine_python: str = ""  # "": the appliance's own interpreter
    kernels_lock: str = ""
    at: float = 0.0  # when it was committed
    note: str = ""  # how it came: "configuration file", "upgrade", "rollback"

    @classmethod
    def of(cls, cfg: Config, note: str = "") -> Version:
        return cls(str(cfg.model.path), cfg.model.digest, cfg.served_name, cfg.engine.python,
                   str(cfg.kernels.lock or ""), note=note)

    @property
    def artifacts(self) -> tuple[str, str, str, str]:
        return self.model_path, self.model_digest, self.engine_python, self.kernels_lock

    def same_as(self, other: Version) -> bool:
        return self.artifacts == other.artifacts

    def apply(self, cfg: Config) -> Config:
        """The configuration running this version: only the model, the engine's interpreter and its lock."""
        model = cfg.model.model_copy(update={"path": Path(self.model_path), "digest": self.model_digest,
                                             "served_name": self.served_name})
        engine = cfg.engine.model_copy(update={"python": self.engine_python})
        kernels = cfg.kernels.model_copy(update={"lock": Path(self.kernels_lock) if self.kernels_lock else None})
        return cfg.model_copy(update={"model": model, "engine": engine, "kernels": kernels})

    def describe(self) -> str:
        pin = self.model_digest[:19] if self.model_digest else "unpinned"
        engine = f", engine {self.engine_python}" if self.engine_python else ""
        return f"{self.model_path} ({pin}){engine}"


@dataclass(frozen=True)
class Outcome:
    """How the last upgrade or rollback ended: what the doctor and status show."""

    id: str
    kind: str  # "upgrade" or "rollback"
    result: str  # "committed", "rolled_back", "refused", "interrupted"
    step: str  # the step it ended in
    reason: str
    target: str  # Version.describe() of what it tried
    at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class History:
    base: Version  # the configuration file's version when the box first committed one of its own
    committed: Version
    previous: Version | None = None
    last: Outcome | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> History:
        prev, last = d.get("previous"), d.get("last")
        return cls(Version(**d["base"]), Version(**d["committed"]), Version(**prev) if prev else None,
                   Outcome(**last) if last else None)


@dataclass(frozen=True)
class Journal:
    """An upgrade in progress, rewritten at each step; gone once it is committed or rolled back."""

    id: str
    kind: str
    step: str
    target: Version
    source: Version  # what ran when it began
    started: float

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Journal:
        return cls(d["id"], d["kind"], d["step"], Version(**d["target"]), Version(**d["source"]), d["started"])


class VersionsError(Exception):
    """A versions or journal file that cannot be read; the message names it and what to do."""


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power cut
    finally:
        os.close(fd)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise VersionsError(f"cannot read {path}: {e}; move it aside to start from the configuration file's "
                            "version") from None
    if not isinstance(data, dict):
        raise VersionsError(f"{path} is not a JSON object; move it aside to start from the configuration file's "
                            "version")
    return data


class VersionStore:
    """The state directory's versions and journal files."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir

    @property
    def versions_path(self) -> Path:
        return self.dir / VERSIONS_FILE

    @property
    def journal_path(self) -> Path:
        return self.dir / JOURNAL_FILE

    def history(self) -> History | None:
        d = _read(self.versions_path)
        try:
            return History.from_json(d) if d is not None else None
        except (KeyError, TypeError) as e:
            raise VersionsError(f"{self.versions_path} lacks {e}; move it aside to start from the configuration "
                                "file's version") from None

    def save(self, history: History) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.versions_path, history.to_json())

    def journal(self) -> Journal | None:
        d = _read(self.journal_path)
        try:
            return Journal.from_json(d) if d is not None else None
        except (KeyError, TypeError):
            return None  # a journal from another release: it says only that an upgrade was under way

    def write_journal(self, journal: Journal) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.journal_path, asdict(journal))

    def clear_journal(self) -> None:
        self.journal_path.unlink(missing_ok=True)

    # -- the decisions ---------------------------------------------------------------------------------

    def current(self, file_version: Version) -> History | None:
        """The history that applies to the configuration file's version, or None (none yet, or the file
        changed since)."""
        h = self.history()
        if h is None or not h.base.same_as(file_version):
            return None
        return h

    def commit(self, file_version: Version, new: Version, replaced: Version, outcome: Outcome) -> History:
        """`new` becomes the committed version; `replaced`, what ran before it (with the digest its folder
        hashed to, so a rollback can check it), becomes the previous one."""
        h = self.current(file_version)
        base = h.base if h else replace(file_version, note="configuration file")
        history = History(base, replace(new, at=time.time()), replaced, outcome)
        self.save(history)
        self.clear_journal()
        return history

    def record(self, file_version: Version, outcome: Outcome) -> None:
        """An upgrade that did not commit: the committed version stays, the outcome is kept for the doctor."""
        h = self.current(file_version)
        base = replace(file_version, note="configuration file")
        self.save(replace(h, last=outcome) if h else History(base, base, None, outcome))
        self.clear_journal()

    def recover(self, file_version: Version) -> Outcome | None:
        """At start: an upgrade the daemon was killed in. The committed version serves (never a half-swap);
        the outcome says so. None when no upgrade was under way."""
        j = self.journal()
        if j is None:
            if self.journal_path.exists():
                self.clear_journal()
            return None
        h = self.current(file_version)
        committed = h.committed if h else file_version
        if j.target.same_as(committed):
            outcome = Outcome(j.id, j.kind, "committed", j.step, "the daemon stopped after the commit",
                              j.target.describe())
        else:
            outcome = Outcome(j.id, j.kind, "interrupted", j.step,
                              f"the daemon stopped during {j.step}; the committed version serves "
                              f"({committed.describe()})", j.target.describe())
        self.record(file_version, outcome)
        return outcome


def effective_config(file_cfg: Config) -> tuple[Config, str | None]:
    """The configuration the daemon runs: the file's, with the box's committed version applied; and a line
    for the log when the two differ or the file overrode the box's history."""
    store = VersionStore(file_cfg.state.directory)
    h = store.history()
    if h is None:
        return file_cfg, None
    if not h.base.same_as(Version.of(file_cfg)):
        return file_cfg, (f"the configuration file names another version than when this box was last upgraded "
                          f"({Version.of(file_cfg).describe()}); it wins over the box's committed "
                          f"{h.committed.describe()}")
    if h.committed.same_as(h.base):
        return file_cfg, None
    return h.committed.apply(file_cfg), f"serving the version committed on this box: {h.committed.describe()}"

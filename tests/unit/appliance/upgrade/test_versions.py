"""The box's committed version, the one before it, and the journal of an upgrade in progress."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from appliance.boot import config
from appliance.upgrade.versions import (
    JOURNAL_FILE,
    VERSIONS_FILE,
    Journal,
    Outcome,
    Version,
    VersionsError,
    VersionStore,
    effective_config,
)

A = "sha256:" + "a" * 64
B = "sha256:" + "b" * 64
C = "sha256:" + "c" * 64


def _file_cfg(tmp_path: Path, model: str = "/models/a", digest: str = A) -> config.Config:
    return config.parse(f'[model]\npath = "{model}"\ndigest = "{digest}"\nserved_name = "site-model"\n'
                        f'[state]\ndirectory = "{tmp_path}/state"\n')


def _outcome(result: str = "committed") -> Outcome:
    return Outcome("id1", "upgrade", result, "commit", "fine", "target")


def _version(path: str, digest: str, python: str = "") -> Version:
    return Version(path, digest, "site-model", python)


def test_without_history_the_file_rules(tmp_path: Path):
    cfg = _file_cfg(tmp_path)
    assert effective_config(cfg) == (cfg, None)


def test_a_commit_is_served_from_then_on_and_keeps_the_previous(tmp_path: Path):
    cfg = _file_cfg(tmp_path)
    store = VersionStore(cfg.state.directory)
    file_v = Version.of(cfg)
    store.commit(file_v, _version("/models/b", B, "/opt/vllm-next/bin/python"), file_v, _outcome())
    eff, note = effective_config(cfg)
    assert eff.model.path == Path("/models/b") and eff.model.digest == B
    assert eff.engine.python == "/opt/vllm-next/bin/python"
    assert eff.served_name == "site-model"  # clients keep sending the same id
    assert note and "committed on this box" in note
    h = store.current(file_v)
    assert h is not None and h.previous is not None and h.previous.model_digest == A
    # a second upgrade: the first becomes the previous one
    store.commit(file_v, _version("/models/c", C), _version("/models/b", B), _outcome())
    h = store.current(file_v)
    assert h is not None and h.committed.model_digest == C and h.previous is not None
    assert h.previous.model_digest == B and h.base.model_digest == A


def test_a_changed_configuration_file_wins_over_the_box_history(tmp_path: Path):
    cfg = _file_cfg(tmp_path)
    VersionStore(cfg.state.directory).commit(Version.of(cfg), _version("/models/b", B), Version.of(cfg), _outcome())
    pushed = _file_cfg(tmp_path, "/models/z", C)
    eff, note = effective_config(pushed)
    assert eff.model.path == Path("/models/z")
    assert note and "it wins" in note
    assert VersionStore(pushed.state.directory).current(Version.of(pushed)) is None


def test_an_upgrade_that_did_not_commit_changes_nothing_but_is_recorded(tmp_path: Path):
    cfg = _file_cfg(tmp_path)
    store = VersionStore(cfg.state.directory)
    store.record(Version.of(cfg), _outcome("rolled_back"))
    assert effective_config(cfg)[0] == cfg
    h = store.current(Version.of(cfg))
    assert h is not None and h.last is not None and h.last.result == "rolled_back"


@pytest.mark.parametrize("step", ["stage", "swap", "gate", "probation"])
def test_a_daemon_killed_mid_upgrade_comes_back_on_the_committed_version(tmp_path: Path, step: str):
    cfg = _file_cfg(tmp_path)
    store = VersionStore(cfg.state.directory)
    store.write_journal(Journal("u1", "upgrade", step, _version("/models/b", B), Version.of(cfg), 0.0))
    outcome = VersionStore(cfg.state.directory).recover(Version.of(cfg))  # the restarted daemon
    assert outcome is not None and outcome.result == "interrupted" and outcome.step == step
    assert f"stopped during {step}" in outcome.reason
    assert effective_config(cfg)[0].model.path == Path("/models/a")
    assert not (cfg.state.directory / JOURNAL_FILE).exists()
    assert store.recover(Version.of(cfg)) is None  # said once


def test_a_daemon_killed_between_commit_and_clearing_the_journal_says_it_committed(tmp_path: Path):
    cfg = _file_cfg(tmp_path)
    store = VersionStore(cfg.state.directory)
    target = _version("/models/b", B)
    store.commit(Version.of(cfg), target, Version.of(cfg), _outcome())
    store.write_journal(Journal("u1", "upgrade", "commit", target, Version.of(cfg), 0.0))
    outcome = store.recover(Version.of(cfg))
    assert outcome is not None and outcome.result == "committed"
    assert effective_config(cfg)[0].model.path == Path("/models/b")


def test_files_are_replaced_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A write that dies half-way leaves the old file as it was (the new one is written beside it)."""
    cfg = _file_cfg(tmp_path)
    store = VersionStore(cfg.state.directory)
    store.commit(Version.of(cfg), _version("/models/b", B), Version.of(cfg), _outcome())
    before = (cfg.state.directory / VERSIONS_FILE).read_text()

    def dies(*_a: object) -> None:
        raise OSError("killed")

    monkeypatch.setattr(os, "replace", dies)
    with pytest.raises(OSError):
        store.commit(Version.of(cfg), _version("/models/c", C), Version.of(cfg), _outcome())
    assert (cfg.state.directory / VERSIONS_FILE).read_text() == before


def test_an_unreadable_versions_file_says_what_to_do(tmp_path: Path):
    cfg = _file_cfg(tmp_path)
    cfg.state.directory.mkdir(parents=True)
    (cfg.state.directory / VERSIONS_FILE).write_text("{not json")
    with pytest.raises(VersionsError, match="move it aside"):
        effective_config(cfg)
    (cfg.state.directory / VERSIONS_FILE).write_text(json.dumps({"base": {}}))
    with pytest.raises(VersionsError, match="move it aside"):
        effective_config(cfg)

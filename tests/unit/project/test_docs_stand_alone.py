"""The repository stands on its own: every file the code and docs point at is in it, and nothing points
at notes outside it (the development workspace's shared notes live in docs/)."""

from __future__ import annotations

import re
import subprocess

from tests.support import REPO

TEXT = (".py", ".md", ".sh", ".spec", ".toml", ".conf", ".service", "Makefile", "Containerfile", "run")
POINTER = re.compile(r"(?<![\w/.~$-])((?:docs|bench|tests|packaging|scripts|systemd|appliance|kvbudget|cascade|kernels|dev)"
                     r"/[\w./-]*\w\.(?:md|py|sh|toml|json|spec|conf|service))\b")
OUTSIDE = re.compile(r"ENGINE-NOTES\.md|KV-ACCOUNTING\.md|ARCHITECTURE\.md|\.\./shared|seeds/|\b00\d_[0-9a-f]{16}\.txt")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if f.endswith(TEXT) and (REPO / f).is_file()]


def test_every_pointer_to_a_repository_file_resolves():
    missing = []
    for f in _tracked():
        for n, line in enumerate((REPO / f).read_text(errors="replace").splitlines(), 1):
            for ref in POINTER.findall(line):
                if not (REPO / ref).exists() and "*" not in ref:
                    missing.append(f"{f}:{n}: {ref}")
    assert missing == [], "\n".join(missing)


def test_nothing_points_outside_the_repository():
    found = [f"{f}:{n}: {line.strip()[:120]}" for f in _tracked() if f != "tests/unit/project/test_docs_stand_alone.py"
             for n, line in enumerate((REPO / f).read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert found == [], "\n".join(found)


def test_the_pointer_pattern_finds_pointers():
    """A check that can fail: the pattern sees a pointer written the way the docs write them."""
    assert POINTER.findall("see docs/kv-accounting.md, section 6, and bench/outbox.py.") == [
        "docs/kv-accounting.md", "bench/outbox.py"]
    assert OUTSIDE.search("(ENGINE-NOTES.md lists them)") and OUTSIDE.search("section 7.6 of 001_8b59aade82f273eb.txt")


MD_LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)#\s]+)(?:#[^)]*)?\)")


def test_every_markdown_link_resolves():
    """README and docs link each other by relative path; a moved or renamed page breaks this."""
    broken = [f"{f}: {target}" for f in _tracked() if f.endswith(".md")
              for target in MD_LINK.findall((REPO / f).read_text()) if not ((REPO / f).parent / target).exists()]
    assert broken == [], "\n".join(broken)
    assert MD_LINK.findall("see [the API](docs/http-api.md#errors) and [x](https://e.com)") == ["docs/http-api.md"]

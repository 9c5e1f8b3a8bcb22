"""The folders show the architecture (issue 30): appliance/ holds only its parts' folders, each says what it
holds, and the README's map and docs/architecture.md name every part, so neither drifts from the code."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
APPLIANCE = REPO / "appliance"
FOLDERS = {"boot", "runtime", "engine", "api", "ops", "store", "upgrade", "cli"}


def test_appliance_holds_only_its_parts_folders():
    loose = sorted(p.name for p in APPLIANCE.glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"modules outside the part folders: {loose}; put each in one of {sorted(FOLDERS)}"
    folders = {p.name for p in APPLIANCE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == FOLDERS


def test_each_folder_says_what_it_holds():
    for name in FOLDERS:
        init = APPLIANCE / name / "__init__.py"
        if name == "cli":
            continue  # the command group itself: its docstring is the CLI's help
        assert ast.get_docstring(ast.parse(init.read_text())), f"appliance/{name}/__init__.py has no docstring"


def test_the_readme_map_and_the_architecture_page_name_every_part():
    readme = (REPO / "README.md").read_text()
    for name in FOLDERS:
        assert f"`appliance/{name}/`" in readme, f"the README's map does not name appliance/{name}/"
    architecture = (REPO / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(REPO)) for p in sorted(APPLIANCE.glob("*/*.py"))
               if p.name != "__init__.py" and p.parent.name != "cli" and str(p.relative_to(REPO)) not in architecture]
    assert missing == [], f"docs/architecture.md does not name {missing}"

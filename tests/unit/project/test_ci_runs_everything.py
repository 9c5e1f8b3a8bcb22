"""Under CI=true a skipped test fails, naming what it skipped for (tests/conftest.py): a missing tool,
package or privilege on a fresh machine must show, not pass green."""

from __future__ import annotations

import pytest

from tests.support import REPO

SKIPPING = """
import pytest

def test_needs_a_tool():
    pytest.skip("frobnicate is not installed")

@pytest.mark.skipif(True, reason="needs root")
def test_needs_root():
    pass

@pytest.mark.xfail(reason="known engine bug", strict=True)
def test_known_bug():
    assert False

def test_plain():
    assert True
"""

MODULE_SKIP = """
import pytest
pytest.importorskip("a_package_nobody_has_42")

def test_never_collected():
    pass
"""


@pytest.fixture()
def project(pytester: pytest.Pytester, monkeypatch) -> pytest.Pytester:
    """A scratch project whose conftest is this suite's own."""
    pytester.makeconftest((REPO / "tests/conftest.py").read_text().replace(
        'pytest_plugins = ["pytester"]', "pytest_plugins = []"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the conftest imports tests.support
    return pytester


@pytest.mark.parametrize("ci", ["true", "1"])
def test_a_skip_fails_under_ci_and_names_its_reason(project: pytest.Pytester, monkeypatch, ci: str):
    monkeypatch.setenv("CI", ci)
    project.makepyfile(test_skipping=SKIPPING)
    result = project.runpytest_subprocess("-p", "no:cacheprovider")
    # a skip in the call fails the test; a skipif (decided in setup) reports it as an error: both fail the run
    result.assert_outcomes(passed=1, failed=1, errors=1, xfailed=1)
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*skipped under CI=true*frobnicate is not installed*",
                                 "*skipped under CI=true*needs root*"])


def test_a_module_skipped_at_collection_fails_under_ci(project: pytest.Pytester, monkeypatch):
    monkeypatch.setenv("CI", "true")
    project.makepyfile(test_module_skip=MODULE_SKIP)
    result = project.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*skipped under CI=true*a_package_nobody_has_42*"])


def test_outside_ci_a_skip_is_a_skip(project: pytest.Pytester, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    project.makepyfile(test_skipping=SKIPPING)
    project.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1, skipped=2, xfailed=1)

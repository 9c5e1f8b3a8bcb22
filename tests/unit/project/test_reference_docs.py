"""docs/configuration.md and docs/cli.md are generated from the code and cannot drift from it."""

from __future__ import annotations

from appliance.ops import reference


def test_the_committed_references_are_what_the_code_generates():
    assert reference.stale() == [], "run `python -m appliance.ops.reference` and commit docs/"


def test_the_references_carry_the_code_s_own_words():
    from appliance.boot.config import EngineSection

    config_md, cli_md = reference.configuration_md(), reference.cli_md()
    assert EngineSection.model_fields["kv_cache_memory_bytes"].description in config_md
    assert "| `kv_cache_memory_bytes` |" in config_md and "## [engine]" in config_md
    assert "## [admission.classes.<name>]" in config_md  # a dict of sections is documented once
    assert "## `appliance plan`" in cli_md and "--model-only" in cli_md
    assert "## `appliance keys create`" in cli_md and "[gold|silver|bronze]" in cli_md  # choices from the type

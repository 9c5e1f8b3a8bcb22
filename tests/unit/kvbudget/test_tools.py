"""Tool calling and reasoning planned per model (kvbudget.tools): the families the product's background
names get the parser vLLM documents for them, a chat template that cannot show the model its tools leaves
auto off and says what works, an operator's choice wins, and every name is one vLLM 0.32 registers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvbudget.model_files import read_model
from kvbudget.tools import FAMILIES, GENERIC, plan_tools

MODELS = Path(__file__).resolve().parents[2] / "fixtures" / "models"
# Stand-ins for each family's chat template: what the choice reads of one (whether it renders `tools`,
# whether it thinks, Llama 3's header tokens).
WITH_TOOLS = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
THINKING = WITH_TOOLS + "<think>\n"
LLAMA3 = "<|start_header_id|>system<|end_header_id|>" + WITH_TOOLS
CHATML_NO_TOOLS = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"


def _model(fixture: str, template: str | None):
    """A fixture's config.json; "name:type" reads it as another model_type (no DeepSeek-V3 fixture here:
    the V2 config stands in for the family's shape)."""
    name, _, kind = fixture.partition(":")
    shape = replace(read_model(MODELS / f"{name}.json"), chat_template=template)
    return replace(shape, model_type=kind) if kind else shape


@pytest.mark.parametrize(("fixture", "template", "tool", "reasoning", "auto"), [
    ("qwen3.6-27b", THINKING, "qwen3_coder", "qwen3", True),
    ("qwen3.5-35b-a3b", THINKING, "qwen3_coder", "qwen3", True),
    ("qwen3-8b", THINKING, "hermes", "qwen3", True),
    ("qwen3-next-80b-a3b", THINKING, "hermes", "qwen3", True),
    ("qwen2.5-7b-instruct-awq", WITH_TOOLS, "hermes", None, True),
    ("llama-3.1-8b", LLAMA3, "llama3_json", None, True),
    ("llama-4-scout-17b-16e-instruct", WITH_TOOLS, "llama4_pythonic", None, True),
    ("mistral-7b-v0.1", WITH_TOOLS, "mistral", None, True),
    ("gpt-oss-20b", WITH_TOOLS + "reasoning_content", "openai", "openai_gptoss", True),
    ("granite-4.0-h-tiny", WITH_TOOLS, "granite4", None, True),
    ("deepseek-v2-lite-chat:deepseek_v3", WITH_TOOLS, "deepseek_v3", None, True),
    # Gemma 3's own template never renders tools: named and required only, said so
    ("gemma-3-12b-it", CHATML_NO_TOOLS, "pythonic", None, False),
    # the embedded default: a Llama architecture with a ChatML template and no tools in it
    ("smollm2-135m-instruct", CHATML_NO_TOOLS, GENERIC, None, False),
    # a family known to think, in a checkpoint whose template never does: no reasoning parser
    ("qwen3-8b", WITH_TOOLS, "hermes", None, True),
    # an unknown family with a template that renders tools: its syntax is unknown, so auto stays off
    ("chatglm3-6b", WITH_TOOLS, GENERIC, None, False),
])
def test_each_family_gets_its_parser(fixture, template, tool, reasoning, auto):
    t = plan_tools(_model(fixture, template), template)
    assert (t.tool_call_parser, t.reasoning_parser, t.auto) == (tool, reasoning, auto), t
    # vLLM 0.32 uses a tool parser only with --enable-auto-tool-choice, whichever the tool choice
    assert t.args[:3] == ("--tool-call-parser", tool, "--enable-auto-tool-choice")
    if not auto:
        assert "auto does not" in t.summary() and "named and required" in t.summary()


def test_the_operator_s_choice_wins_and_none_turns_them_off():
    m = _model("smollm2-135m-instruct", WITH_TOOLS)
    named = plan_tools(m, WITH_TOOLS, tool_call_parser="hermes", reasoning_parser="qwen3")
    assert (named.tool_call_parser, named.reasoning_parser, named.auto) == ("hermes", "qwen3", True)
    off = plan_tools(m, WITH_TOOLS, tool_call_parser="none", reasoning_parser="none")
    assert off.args == () and off.summary().startswith("tool calls off")


def test_the_template_is_read_from_the_model_folder(tmp_path):
    import json
    import shutil

    shutil.copy(MODELS / "smollm2-135m-instruct.json", tmp_path / "config.json")
    assert read_model(tmp_path).chat_template is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": CHATML_NO_TOOLS}, {"name": "tool_use", "template": WITH_TOOLS}]}))
    assert read_model(tmp_path).chat_template == CHATML_NO_TOOLS
    (tmp_path / "chat_template.jinja").write_text(WITH_TOOLS)  # the file wins, as in transformers
    assert read_model(tmp_path).chat_template == WITH_TOOLS


def test_every_parser_name_is_one_vllm_registers():
    """Against vLLM's own registries (the installed engine), not a copy of them."""
    import json
    import subprocess
    import sys

    # In a process of its own: importing vllm sets environment variables (LD_LIBRARY_PATH, torch's caches)
    # that every engine this test session starts afterwards would inherit.
    listed = subprocess.run([sys.executable, "-c", (
        "import json; from vllm.tool_parsers import ToolParserManager as T; "
        "from vllm.reasoning import ReasoningParserManager as R; "
        "print(json.dumps([T.list_registered(), R.list_registered()]))")],
        capture_output=True, text=True, check=True, timeout=300).stdout.strip().splitlines()[-1]
    tools, reasoning = map(set, json.loads(listed))
    named_tools = {t for t, _, _ in FAMILIES.values()} | {GENERIC, "llama3_json"}
    named_reasoning = {r for _, r, _ in FAMILIES.values() if r}
    assert named_tools - tools == set() and named_reasoning - reasoning == set()

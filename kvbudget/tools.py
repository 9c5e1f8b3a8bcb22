"""Tool calling and reasoning output, chosen per model as an operator reading vLLM's tool-calling docs
would: the parser that reads the model family's tool-call syntax (`--tool-call-parser`), the one that
separates its thinking (`--reasoning-parser`), and whether `tool_choice: "auto"` can work at all.

Two facts of vLLM (0.32) decide it:
- A named or required tool choice is answered through structured output: the arguments are decoded
  under the tool's JSON schema, whatever the chat template says, by any parser that takes that generic
  path. Parsers that force their model's own syntax instead (a structural tag, `hermes` and `llama3_json`
  among them, under VLLM_ENFORCE_STRICT_TOOL_CALLING, vLLM's default) only work with a model trained on
  that syntax. A model with no tool syntax of its own gets `pythonic`, which takes the generic path.
- vLLM 0.32 uses a tool parser only with `--enable-auto-tool-choice` (its parser manager returns none
  without it, and named and required choices are then refused as "requires --tool-call-parser"), so the
  flag goes with every parser.
- `auto` needs the model to be shown the tools: a chat template that renders them. Without one the model
  never sees them and answers as if none were given; the plan says so (`auto` False), and the gateway
  refuses an auto choice that comes before any tool result (where the model would have to pick a tool it
  is not shown) with a 400 naming what works; after a tool's result the model answers in text, which works.

Pure: the model's config.json fields and its chat template in, a `ToolCalling` out. vLLM's argument
parser checks the names when the plan's command line goes through the probe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvbudget.model import ModelShape

# model_type -> (tool-call parser, reasoning parser or None, the family in words). Names from vLLM's
# tool_parsers/ and reasoning/ registries (0.32) and its tool-calling documentation.
FAMILIES: dict[str, tuple[str, str | None, str]] = {
    "qwen3_5": ("qwen3_coder", "qwen3", "Qwen3.5/3.6 (XML tool calls, <think> reasoning)"),
    "qwen3_5_moe": ("qwen3_coder", "qwen3", "Qwen3.5/3.6 MoE (XML tool calls, <think> reasoning)"),
    "qwen3_next": ("hermes", "qwen3", "Qwen3-Next (<tool_call> JSON, <think> reasoning)"),
    "qwen3": ("hermes", "qwen3", "Qwen3 (<tool_call> JSON, <think> reasoning)"),
    "qwen3_moe": ("hermes", "qwen3", "Qwen3 MoE (<tool_call> JSON, <think> reasoning)"),
    "qwen2": ("hermes", None, "Qwen2.5 (<tool_call> JSON)"),
    "llama4": ("llama4_pythonic", None, "Llama 4 (pythonic tool calls)"),
    "mistral": ("mistral", None, "Mistral ([TOOL_CALLS])"),
    "mistral3": ("mistral", None, "Mistral Small 3.x ([TOOL_CALLS])"),
    "deepseek_v3": ("deepseek_v3", None, "DeepSeek-V3 (its tool-call tokens)"),
    "deepseek_v32": ("deepseek_v32", "deepseek_v3", "DeepSeek-V3.2"),
    "gpt_oss": ("openai", "openai_gptoss", "gpt-oss (harmony channels)"),
    "granite": ("granite", "granite", "Granite 3.x (<|tool_call|>)"),
    "granitemoe": ("granite", "granite", "Granite 3.x MoE (<|tool_call|>)"),
    "granitemoehybrid": ("granite4", None, "Granite 4 (<tool_call> JSON)"),
    "gemma3": ("pythonic", None, "Gemma 3 (pythonic tool calls)"),
    "gemma3_text": ("pythonic", None, "Gemma 3 (pythonic tool calls)"),
    "gemma4": ("gemma4", "gemma4", "Gemma 4"),
}
GENERIC = "pythonic"  # takes vLLM's generic JSON-schema path for named and required tool choices
_LLAMA3_TEMPLATE = "<|start_header_id|>"  # Llama 3.x's chat format (a "llama" model_type is not enough)
_THINKING = re.compile(r"<think>|reasoning_content|enable_thinking")


@dataclass(frozen=True)
class ToolCalling:
    tool_call_parser: str | None
    reasoning_parser: str | None
    auto: bool  # tool_choice "auto" works: the template shows the model its tools
    renders_tools: bool | None  # None: no chat template found
    why: str

    @property
    def args(self) -> tuple[str, ...]:
        out: list[str] = []
        if self.tool_call_parser:
            out += ["--tool-call-parser", self.tool_call_parser, "--enable-auto-tool-choice"]
        if self.reasoning_parser:
            out += ["--reasoning-parser", self.reasoning_parser]
        return tuple(out)

    def summary(self) -> str:
        if not self.tool_call_parser:
            return f"tool calls off: {self.why}"
        works = "named, required and auto" if self.auto else "named and required (through structured output)"
        line = f"tool calls: parser {self.tool_call_parser}; {works} tool choices work; {self.why}"
        if not self.auto:
            line += ("; auto does not: the chat template does not show the model its tools (refused with a 400 "
                     "before a tool result; after one the model answers in text)")
        if self.reasoning_parser:
            line += f"; reasoning parser {self.reasoning_parser}"
        return line


def renders_tools(template: str | None) -> bool | None:
    """Whether a Jinja chat template shows the model the request's tools (reads the `tools` variable)."""
    if template is None:
        return None
    return re.search(r"\btools\b", template) is not None


def plan_tools(model: ModelShape, template: str | None, tool_call_parser: str = "auto",
               reasoning_parser: str = "auto") -> ToolCalling:
    """tool_call_parser / reasoning_parser: "auto" (from the model), "none", or a vLLM parser name."""
    shows = renders_tools(template)
    kind = model.model_type.removesuffix("_text")  # a multimodal model's language half: qwen3_5_text, llama4_text
    family = FAMILIES.get(kind) or FAMILIES.get(model.model_type)
    if family is None and kind == "llama" and template and _LLAMA3_TEMPLATE in template:
        family = ("llama3_json", None, "Llama 3.x (JSON tool calls)")
    if tool_call_parser == "auto":
        if family is not None:
            tool, why = family[0], f"{family[2]}, from its config.json"
        else:
            tool, why = GENERIC, (f"no tool-call syntax known for model_type '{kind}': named and "
                                  "required choices are decoded under the tool's schema")
    elif tool_call_parser == "none":
        tool, why = None, "engine.tool_call_parser = \"none\""
    else:
        tool, why = tool_call_parser, f"engine.tool_call_parser = \"{tool_call_parser}\""
    if reasoning_parser == "auto":
        reasoning = family[1] if family is not None else None
        if reasoning and template is not None and not _THINKING.search(template):
            reasoning = None  # a checkpoint of the family whose template never thinks
    else:
        reasoning = None if reasoning_parser == "none" else reasoning_parser
    # auto needs the model to write calls in the syntax its parser reads: a known family, or the operator's word
    auto = bool(tool) and shows is True and (family is not None or tool_call_parser != "auto")
    return ToolCalling(tool, reasoning, auto, shows, why)

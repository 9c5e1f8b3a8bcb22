"""Runs inside the quantizing environment (quantize/env.py), never in the appliance's or the engine's: it
imports LLM Compressor, whose pins (compressed-tensors, transformers) differ from vLLM's. It is started as
`python -I worker.py SPEC.json` and reads everything it needs from the spec, which quantize/build.py
writes; it imports nothing of the appliance. On success its last line on stdout is a JSON object with the
versions of the tools that made the build.

The spec: {"source", "out", "preset", "algorithm": "gptq"|"rtn", "group_size": int|null,
"ignore": [...], "calibration": {"conversations": path|null, "samples": int, "max_seq_length": int}}, where
the conversations file holds one {"messages": [...]} per line, rendered with the model's own chat template
(the text the engine will see), or {"text": ...}, taken as it is.
"""

from __future__ import annotations

import json
import shutil
import sys
from importlib import metadata
from pathlib import Path

# Files a model folder carries beside its weights that the saved build must keep (the chat template
# decides how the engine renders a conversation; generation_config its sampling defaults).
_KEEP_FROM_SOURCE = ("chat_template.jinja", "generation_config.json")
_TOOLS = ("llmcompressor", "compressed-tensors", "transformers", "torch")


def _recipe(spec: dict):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    modifier = GPTQModifier if spec["algorithm"] == "gptq" else QuantizationModifier
    if spec["group_size"] is None:
        return modifier(targets="Linear", scheme=spec["preset"], ignore=spec["ignore"])
    # The W4A16 preset fixes groups of 128 columns; a model whose layers are not multiples of that (the
    # default model's 576) gets the group the appliance chose from its shapes.
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                               group_size=spec["group_size"])
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    return modifier(config_groups={"group_0": scheme}, ignore=spec["ignore"])


def _calibration(spec: dict, tokenizer):
    cal = spec["calibration"]
    if cal["conversations"] is None:
        return None
    from datasets import Dataset

    texts = []
    for item in (json.loads(line) for line in Path(cal["conversations"]).read_text().splitlines() if line.strip()):
        if "text" in item:
            texts.append(item["text"])
        else:
            messages = item["messages"]
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False,
                                                       add_generation_prompt=messages[-1]["role"] != "assistant"))
    tokens = tokenizer(texts, max_length=cal["max_seq_length"], truncation=True, add_special_tokens=False)
    return Dataset.from_dict({"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]})


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, out = Path(spec["source"]), Path(spec["out"])
    model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(source)
    dataset = _calibration(spec, tokenizer)
    kwargs = {} if dataset is None else {
        "dataset": dataset, "num_calibration_samples": min(spec["calibration"]["samples"], len(dataset)),
        "max_seq_length": spec["calibration"]["max_seq_length"], "shuffle_calibration_samples": False}
    oneshot(model=model, recipe=_recipe(spec), **kwargs)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    for name in _KEEP_FROM_SOURCE:
        if (source / name).exists() and not (out / name).exists():
            shutil.copy2(source / name, out / name)
    print(json.dumps({"tools": {name: metadata.version(name) for name in _TOOLS}}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -I worker.py SPEC.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))

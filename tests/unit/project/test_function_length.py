"""No function in the product's packages is longer than a reader can hold (issue 30): 60 lines, the
docstring included. kvbudget/vllm_probe.py, a script run inside the engine's interpreter that follows
vLLM's own start-up step by step, is left out."""

from __future__ import annotations

import ast

from tests.support import REPO

LIMIT = 60
PACKAGES = ("appliance", "cascade", "kvbudget", "kernels", "quantize")
EXEMPT = {"kvbudget/vllm_probe.py"}


def long_functions() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in EXEMPT:
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > LIMIT:
                        out.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_function_is_longer_than_the_limit():
    assert long_functions() == []

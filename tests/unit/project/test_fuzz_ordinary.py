"""The fuzz campaign's ordinary requests must be answered 200, so their prompts must be ones the engine
takes: a prompt the embedded model's own tokenizer turns into no tokens at all is refused by vLLM, rightly,
with a 400. A fresh-clone run's random seed once drew such a prompt ("\\u0004") and failed the campaign."""

from __future__ import annotations

from transformers import AutoTokenizer

from tests.fuzz.requests import examples, prompt_texts
from tests.support import default_model_path


def test_ordinary_prompts_never_tokenize_to_nothing():
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    # Plain st.text draws about 8 prompts in 20,000 that tokenize to nothing: enough that this can fail.
    texts = examples(prompt_texts(), 20_000, 20261125)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    empty = [t for t, i in zip(texts, ids, strict=True) if not i]
    assert not empty, f"{len(empty)} ordinary prompts tokenize to nothing, e.g. {empty[:5]!r}"

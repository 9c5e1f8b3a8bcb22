"""Edge LLM inference appliance: one supervised vLLM behind a local OpenAI-compatible API."""

__version__ = "0.1.0"

"""Quantized builds of a model (issue 32): LLM Compressor runs in an environment of its own (its pins and
the engine's disagree), the appliance chooses the scheme's settings, feeds it calibration prompts, and
writes the result atomically with its pin."""

"""Benchmarks of engine techniques against the plain path, same run: speculative decoding,
LoRA, structured output, tool calls (see ``ops/bench/README.md``).
"""

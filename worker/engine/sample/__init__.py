"""Sampling a step's logits: per-request parameters as rows and columns, logits processors,
the fused sampling pass, and prompt logprobs. Reads the schedule's output types; never
the scheduler's internals.
"""

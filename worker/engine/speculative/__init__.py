"""Speculative decoding without a draft model (suffix decoding; docs/engine.md)."""

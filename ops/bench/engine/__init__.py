"""Benchmarks of the engine in one process: throughput and latency against transformers,
the host's share of a step, kernels, memory and the KV tiers, and their shared workloads
and baselines (see ``ops/bench/README.md``).
"""

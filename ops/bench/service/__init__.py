"""Benchmarks of the service path: the gateway, SSE and Redis clients, the outbox and event
publishing, the Batch API, tenants' fair share and the prefix cache's isolation (see
``ops/bench/README.md``).
"""

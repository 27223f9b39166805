"""Benchmarks of the queue on a Redis Cluster: enqueue and pub/sub load across masters, and
failover (see ``ops/bench/README.md``).
"""

"""Redis plumbing of the worker's threads: settings, connections and backoff, leases on
stream entries, blocking-read loops, and per-shard gates on a Redis Cluster.
"""

"""The outbox thread: every step's events to Redis in one pipelined round trip, per master
on a Redis Cluster.
"""

"""Redis Cluster and pub/sub plumbing: node clients, the hash-tagged key names, the
replicated enqueue, per-shard reads and health, and the pub/sub hubs (one connection, or
one per master with SSUBSCRIBE). Imports only ``protocol``'s own modules.
"""

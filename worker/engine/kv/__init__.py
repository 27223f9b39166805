"""The paged KV cache's bookkeeping on the host: the block manager (free list, reference
counts, tables as rows of one array), the prefix cache (chained hashes, kept partial
blocks, a step's registrations) and the host-memory tier. Imports
``worker.engine.request`` only; never the runner, the sampler or the scheduler.
"""

"""The inference engine: everything one ``Engine.step()`` uses, and no I/O.

Request counters, the block manager, the scheduler, the model runner and its attention
backends, the sampler and the detokenizer; ``engine.Engine`` ties them together and
``llm.LLM`` is the offline API. Nothing here imports ``worker.service`` (the Redis
process around the engine). Importing this package loads nothing heavy: torch comes in
with the modules that need it.
"""

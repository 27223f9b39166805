"""The worker process around the engine: Redis intake, outbox and control threads, leases,
dead letters, stats, metrics and the process wiring (``main.run_worker``).

It depends on ``worker.engine`` and ``protocol``; the engine never imports it.
"""

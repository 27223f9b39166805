"""The worker's numbers: Prometheus series (the engine's, LoRA's, per tenant) and the stats
its heartbeat carries.
"""

"""The fleet's LoRA adapters on the wire: the registry in Redis (records, owners,
registration) and the confinement of adapter paths to the configured roots. Imports only
``protocol``'s own modules.
"""

"""Which models this gateway serves: the base models workers advertise, and the fleet's
LoRA adapters each tenant may see, use, load and unload (routing a caller's adapter name
to its registry key). Imports ``gateway.tenancy`` and the protocol; never the routes.
"""

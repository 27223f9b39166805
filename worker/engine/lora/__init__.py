"""Multi-LoRA: many PEFT adapters over one base model, applied per row in one forward.

Adapters load from the PEFT format (``adapter.py``), wait in a host cache
(``host_cache.py``), are copied into a few device slots (``slots.py``), and each wrapped
projection (``layer.py``) adds its rows' shrink/expand products using the step's
token-to-slot metadata (``metadata.py``); ``manager.py`` is what the model runner holds.
"""

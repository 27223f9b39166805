"""Threads beside the engine loop: control (cancels, heartbeat, lease renewal), the
tokenizer responder, the LoRA registry sync, and the fleet's draft feed.
"""

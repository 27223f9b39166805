"""Prompts in: text, token ids or chat messages (tools and tool turns included) ->
validated token ids, and the token sequences bad words forbid. Torch-free; imports no
other room of the engine.
"""

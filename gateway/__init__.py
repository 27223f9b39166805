"""Ferry's HTTP gateway: OpenAI-compatible and jobs APIs in front of the Redis queue.

No torch, no tokenizer: prompts travel as text, token ids or chat messages, and the
worker owns tokenization and chat templates.
"""

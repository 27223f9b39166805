"""OpenAI's shapes: request bodies and their fields, response bodies, stream chunks, logprobs.

What an OpenAI or vLLM client sends and gets back, mapped to and from the wire protocol.
No routes and no Redis here: the routes (``gateway/routes``) call these.
"""

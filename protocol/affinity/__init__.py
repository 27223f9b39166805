"""Prefix affinity on the wire: the text-level chunk hashes of a request's prompt, the
per-worker board of what each worker's prefix cache holds, and the preference mark a
producer puts on a request so the worker holding its prefix is offered it first."""

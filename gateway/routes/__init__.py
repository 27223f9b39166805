"""The HTTP routes, one module per API: OpenAI, jobs, files, batches, health.

Routes parse, check and answer; the shapes live in ``gateway/openai_api``, the tenancy
rules in ``gateway/tenancy`` and the queue in ``gateway/queue_client.py``.
"""

"""Tenancy: which tenant an API key belongs to, who is calling, and the tenant's quotas.

Every route resolves its caller here before it touches a job, a file or a batch.
"""

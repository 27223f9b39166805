"""Tenants on the wire: scoped request ids, the prefix cache's partition, and the fair
backlog that shares the fleet's tokens by weight. Imports only ``protocol``'s own
modules.
"""

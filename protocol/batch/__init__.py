"""The Batch API's records in Redis (files, batches, their states) and the commands that
create, follow and finish them. Imports only ``protocol``'s own modules.
"""

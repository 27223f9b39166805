"""The Batch API's driver, ``ferry batcher``: a process of its own, beside the HTTP app.

It leases batches that the routes created, validates their lines with the same checks as
the HTTP routes, feeds them to the low-priority lane and writes the output files.
"""

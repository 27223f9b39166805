"""The output process (``FERRY_OUTPUT_PROCESS``): token ids -> text and Redis events off
the engine's GIL, the link that feeds it, and the job table on the engine's side.
"""

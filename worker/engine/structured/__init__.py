"""Constrained decoding: grammars compiled off the loop, per-request matchers, the step's
token masks, and the tool-call budget. Imports the request only.
"""

"""Structured output on the wire: the one constraint a request's text follows, JSON Schema
preparation, and tool calls (the functions offered, their grammar and parser per
template family). Imports only ``protocol``'s own modules.
"""

"""Prefix affinity on the worker: what its prefix cache holds, advertised on its board
(``protocol/affinity/board.py``), and how the requests it pulled were routed."""

"""Quantized-weight kernels: the C++ INT8 weight-only linear layer for CPU decode steps
(``cpu_int8_linear``). The layers that call them live in ``worker/engine/runner/quant``."""

"""Paged attention behind transformers' ``AttentionInterface``: the metadata a forward
hands its layers, and the backends (Triton kernels on CUDA, the C++ kernel and pure
torch on CPU).
"""

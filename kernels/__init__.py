"""Paged-attention and sampling kernels: Triton launchers for CUDA, the C++ CPU kernel, pure torch.

Import a launcher from its own module (``from kernels.decode_attention import
paged_decode_attention``): the package itself imports no Triton module, so a CPU worker,
which never launches a Triton kernel, runs without triton installed (the CPU worker image
leaves it out, about 1 GB). Importing a launcher is cheap and safe without a GPU: nothing
touches CUDA until it is called. ``kernels.reference`` and ``kernels.sampling_reference``
hold the pure-torch twins.
"""

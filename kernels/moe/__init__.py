"""Mixture-of-experts kernels: the fused Triton kernel for CUDA (``fused``) and the grouped
torch path for CPU (``grouped``). Their oracle is ``kernels.reference.moe_experts``."""

"""Quantized weights: FP8 W8A8, INT8 and INT4 weight-only, at load or from a checkpoint.

The loader calls two functions and nothing else: ``prepare`` (which scheme, from the
``--quantization`` setting or the checkpoint's ``quantization_config``; refuses what is not
implemented, by name) and ``apply`` (replaces the model's linear layers by quantized ones
after transformers has built the model). The matmuls are PyTorch's own kernels where they
fit: ``torch._scaled_mm`` for FP8 on CPU and CUDA alike, ``torch._weight_int8pack_mm`` and
``torch._weight_int4pack_mm_for_cpu`` for weight-only integers on CPU.
"""

from worker.engine.runner.quant.apply import apply, loading, prepare
from worker.engine.runner.quant.config import (
    METHODS,
    SUPPORTED_CHECKPOINT_METHODS,
    QuantizationError,
    QuantScheme,
)

__all__ = ["METHODS", "SUPPORTED_CHECKPOINT_METHODS", "QuantScheme", "QuantizationError",
           "apply", "loading", "prepare"]

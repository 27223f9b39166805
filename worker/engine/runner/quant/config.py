"""What a quantized model runs: one frozen ``QuantScheme`` per model, and the names of the
methods and checkpoint formats Ferry implements (anything else is refused by name)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# ``--quantization`` / ``FERRY_QUANTIZATION`` / ``LLM(quantization=...)``: quantize a
# 16/32-bit checkpoint at load
METHODS = ("fp8", "int8", "int4")
# ``quantization_config.quant_method`` of the checkpoints Ferry loads itself (the loader's
# feature check accepts exactly these)
SUPPORTED_CHECKPOINT_METHODS = frozenset({"compressed-tensors", "modelopt", "awq", "gptq"})
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's packed int4 CPU kernel takes

Method = Literal["fp8", "int8", "int4"]
ActScheme = Literal["none", "dynamic_token", "static_tensor"]


class QuantizationError(ValueError):
    """A scheme, group size, bit width, layer type or combination Ferry does not implement."""


@dataclass(frozen=True)
class QuantScheme:
    """How every quantized linear layer of one model stores and multiplies its weight.

    ``source``: ``load`` quantizes the checkpoint's float weights here; a format name reads
    already-quantized tensors (``compressed-tensors``, ``modelopt``, ``awq``, ``gptq``).
    ``weight_strategy``: one scale per tensor, per output channel, or per group of
    ``group_size`` input columns. ``activations``: FP8 only; per-token scales computed at
    run time, or one static scale per tensor from the checkpoint. ``ignore``: module names
    (exact, or ``re:`` regular expressions, compressed-tensors' convention) left unquantized.
    ``head``: also quantize the embedding and LM head (int8 per row; at load only).
    """

    method: Method
    source: str = "load"
    weight_strategy: Literal["tensor", "channel", "group"] = "channel"
    group_size: int = 0
    zero_point: bool = False
    activations: ActScheme = "none"
    ignore: tuple[str, ...] = field(default=("lm_head",))
    head: bool = False
    checkpoint_format: str = ""  # compressed-tensors' format / AWQ version, for messages

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantizationError(f"quantization {self.method!r} is not implemented; "
                                    f"choose one of {', '.join(METHODS)}")
        if self.method == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise QuantizationError(
                f"int4 group size {self.group_size} is not implemented (the packed int4 "
                f"kernel takes {', '.join(map(str, INT4_GROUP_SIZES))})")


def scheme_at_load(method: str) -> QuantScheme:
    """The scheme ``--quantization METHOD`` quantizes a float checkpoint with."""
    name = method.strip().lower()
    if name == "fp8":  # the common production recipe: per-channel weights, per-token acts
        return QuantScheme("fp8", activations="dynamic_token")
    if name == "int8":
        return QuantScheme("int8", head=True)
    if name == "int4":
        return QuantScheme("int4", weight_strategy="group", group_size=128, zero_point=True,
                           head=True)
    raise QuantizationError(f"quantization {method!r} is not implemented; choose one of "
                            f"{', '.join(METHODS)}")

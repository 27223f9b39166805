"""A checkpoint's ``quantization_config`` read into a ``QuantScheme``, or refused by name.

compressed-tensors configs are validated by the ``compressed-tensors`` package's own
pydantic models (its format, not a reading of ours); ModelOpt, AWQ and GPTQ configs are
small flat dictionaries read here.
"""

from __future__ import annotations

from typing import Any

from worker.engine.runner.quant.config import (
    INT4_GROUP_SIZES,
    SUPPORTED_CHECKPOINT_METHODS,
    QuantizationError,
    QuantScheme,
)


def as_dict(config: Any) -> dict[str, Any]:
    """A ``quantization_config`` as transformers may hold it (dict or config object)."""
    if isinstance(config, dict):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise QuantizationError(f"cannot read quantization_config of type {type(config).__name__}")


def scheme_from_checkpoint(config: dict[str, Any]) -> QuantScheme:
    method = str(config.get("quant_method", "")).lower()
    readers = {"compressed-tensors": _compressed_tensors, "modelopt": _modelopt,
               "awq": _awq, "gptq": _gptq}
    if method not in readers:
        raise QuantizationError(
            f"checkpoint quantization method {method or '(none)'!r} is not implemented; Ferry "
            f"loads {', '.join(sorted(SUPPORTED_CHECKPOINT_METHODS))}")
    return readers[method](config)


def _compressed_tensors(config: dict[str, Any]) -> QuantScheme:
    from compressed_tensors.quantization import QuantizationConfig

    try:
        qc = QuantizationConfig.model_validate(config)
    except ValueError as exc:
        raise QuantizationError(f"invalid compressed-tensors config: {exc}") from exc
    if qc.kv_cache_scheme is not None:
        raise QuantizationError("compressed-tensors: a quantized KV cache scheme in the "
                                "checkpoint is not implemented")
    if len(qc.config_groups) != 1:
        raise QuantizationError(f"compressed-tensors: {len(qc.config_groups)} config groups; "
                                "Ferry implements one scheme for every layer")
    group = next(iter(qc.config_groups.values()))
    if list(group.targets) != ["Linear"]:
        raise QuantizationError(f"compressed-tensors: targets {list(group.targets)} are not "
                                "implemented (only Linear layers)")
    w, a = group.weights, group.input_activations
    fmt = str(qc.format)
    ignore = tuple(qc.ignore or ())
    if w is None or group.output_activations is not None:
        raise QuantizationError("compressed-tensors: a scheme without weight quantization or "
                                "with output activations is not implemented")
    strategy = str(getattr(w.strategy, "value", w.strategy))
    if str(w.type.value if hasattr(w.type, "value") else w.type) == "float" \
            and w.num_bits == 8:
        return _ct_fp8(w, a, strategy, fmt, ignore)
    if w.num_bits == 8 and a is None and strategy == "channel" and w.symmetric \
            and fmt in ("naive-quantized", "int-quantized"):
        return QuantScheme("int8", source="compressed-tensors", ignore=ignore,
                           checkpoint_format=fmt)
    raise QuantizationError(
        f"compressed-tensors scheme {w.type} {w.num_bits}-bit {strategy} weights, "
        f"{'no' if a is None else a.type} activations, format {fmt} is not implemented "
        "(Ferry loads FP8 W8A8 float-quantized and INT8 per-channel weight-only)")


def _ct_fp8(w: Any, a: Any, strategy: str, fmt: str, ignore: tuple[str, ...]) -> QuantScheme:
    if strategy not in ("tensor", "channel") or not w.symmetric or w.dynamic:
        raise QuantizationError(f"compressed-tensors fp8: weight strategy {strategy!r} "
                                "is not implemented (per tensor or per channel, symmetric)")
    if a is None:
        raise QuantizationError("compressed-tensors fp8 weight-only (W8A16) is not "
                                "implemented; Ferry runs FP8 W8A8")
    a_strategy = str(getattr(a.strategy, "value", a.strategy))
    if a.dynamic is True and a_strategy == "token":
        acts = "dynamic_token"
    elif not a.dynamic and a_strategy == "tensor":
        acts = "static_tensor"
    else:
        raise QuantizationError(f"compressed-tensors fp8: activation strategy {a_strategy!r} "
                                f"(dynamic={a.dynamic}) is not implemented (dynamic per "
                                "token or static per tensor)")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise QuantizationError(f"compressed-tensors format {fmt!r} is not implemented for fp8")
    return QuantScheme("fp8", source="compressed-tensors", weight_strategy=strategy,  # type: ignore[arg-type]
                       activations=acts, ignore=ignore, checkpoint_format=fmt)  # type: ignore[arg-type]


def _modelopt(config: dict[str, Any]) -> QuantScheme:
    inner = config.get("quantization", config)  # hf_quant_config.json nests it
    algo = str(inner.get("quant_algo", "")).upper()
    if algo != "FP8":
        raise QuantizationError(f"ModelOpt quant_algo {algo or '(none)'!r} is not implemented "
                                "(Ferry loads FP8)")
    if inner.get("kv_cache_quant_algo"):
        raise QuantizationError(f"ModelOpt kv_cache_quant_algo "
                                f"{inner['kv_cache_quant_algo']!r} is not implemented")
    ignore = tuple(inner.get("exclude_modules") or inner.get("ignore") or ("lm_head",))
    return QuantScheme("fp8", source="modelopt", weight_strategy="tensor",
                       activations="static_tensor", ignore=ignore, checkpoint_format="FP8")


def _int4_common(name: str, config: dict[str, Any]) -> int:
    bits = int(config.get("bits", config.get("w_bit", 0)))
    if bits != 4:
        raise QuantizationError(f"{name}: {bits}-bit weights are not implemented (4-bit only)")
    group = int(config.get("group_size", config.get("q_group_size", 0)))
    if group not in INT4_GROUP_SIZES:
        raise QuantizationError(f"{name}: group size {group} is not implemented "
                                f"({', '.join(map(str, INT4_GROUP_SIZES))})")
    return group


def _awq(config: dict[str, Any]) -> QuantScheme:
    group = _int4_common("AWQ", config)
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantizationError(f"AWQ version {version!r} is not implemented (gemm packing)")
    if not config.get("zero_point", True):
        raise QuantizationError("AWQ without zero points is not implemented")
    ignore = ("lm_head", *(config.get("modules_to_not_convert") or ()))
    return QuantScheme("int4", source="awq", weight_strategy="group", group_size=group,
                       zero_point=True, ignore=ignore, checkpoint_format=version)


def _gptq(config: dict[str, Any]) -> QuantScheme:
    group = _int4_common("GPTQ", config)
    if config.get("desc_act"):
        raise QuantizationError("GPTQ desc_act (activation-order groups) is not implemented")
    fmt = str(config.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizationError(f"GPTQ checkpoint_format {fmt!r} is not implemented")
    ignore = ("lm_head", *(config.get("modules_to_not_convert") or ()))
    return QuantScheme("int4", source="gptq", weight_strategy="group", group_size=group,
                       zero_point=True, ignore=ignore, checkpoint_format=fmt)

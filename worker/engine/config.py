"""Frozen engine configuration: one small typed object per concern, one ``from_env``.

Passing these objects (instead of loose keyword arguments) keeps constructors short and
makes the whole set of knobs visible in one place. Each setting's one default is its dataclass
field's; ``EngineConfig.from_env`` reads the ``FERRY_*`` variables with a command line's
flags on top, which is how ``ferry worker`` builds the config it hands the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Literal

from worker.engine.lora.config import LoraConfig
from worker.engine.speculative.config import SpeculativeConfig, store_ttl_setting

AttentionBackendName = Literal["auto", "cpu", "torch", "triton"]


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load and how to run it."""

    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto: triton on CUDA; on CPU the C++ decode kernel (cpu), or pure torch without a
    # compiler
    attention_backend: AttentionBackendName = "auto"
    # CPU: linear layers on oneDNN with weights packed at load
    # (worker/engine/runner/cpu/packed_linear.py)
    pack_weights: bool = True
    # CPU, packed weights: up to this many rows a projection takes F.linear instead (the
    # faster side differs by CPU); None: measured at load
    # (worker/engine/runner/cpu/gemv_calibration.py)
    packed_gemv_rows: int | None = None
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings
    trust_remote_code: bool = False
    # CUDA: pure-decode steps replay CUDA graphs (worker/engine/runner/decode_graphs.py); True
    # runs every step eagerly
    enforce_eager: bool = False
    # CPU: the steps of a model of a family worker/engine/runner/cpu/layer_plan.py describes
    # (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, Mixtral, Qwen3-MoE) take
    # worker/engine/runner/cpu/lean_decode.py (the same ops without the modules' Python);
    # False keeps them on the modules
    lean_decode: bool = True
    # Quantize a 16/32-bit checkpoint's weights at load: fp8 | int8 | int4
    # (worker/engine/runner/quant/); None: as the checkpoint is (a quantized checkpoint's
    # own quantization_config is read either way)
    quantization: str | None = None
    # Multi-head latent attention (DeepSeek-V3): cache each token's compressed latent and
    # shared rope key and attend with the weights absorbed; False caches the K and V
    # expanded per head (worker/engine/runner/attention/mla.py)
    mla_latent_cache: bool = True

    def __post_init__(self) -> None:
        rows = self.packed_gemv_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int)
                                 or rows < 0):
            raise ValueError(f"packed_gemv_rows must be an integer >= 0 or None (measured), "
                             f"got {rows!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and how many blocks to preallocate."""

    block_size: int = 16
    num_blocks: int | None = None  # explicit pool size wins over memory_bytes
    memory_bytes: int | None = None  # default: 2 GiB on CPU, 90% of free memory on CUDA
    # auto (= model dtype) | bfloat16 | float16 | float32 | fp8_e4m3 (one byte a
    # value, unit scale: twice the sequences of a 16-bit cache; docs/engine.md)
    kv_cache_dtype: str = "auto"
    watermark: float = 0.01  # share of blocks kept free when admitting new requests
    # The KV cache's host tier (kv/host_tier.py): evicted cached blocks copied to host
    # memory and restored instead of recomputed. None: on CUDA 10% of the memory available
    # at start, at most 16 GiB, on a CPU none; 0: off.
    host_memory_bytes: int | None = None
    # Reuse the KV of full blocks whose token prefix was computed before (block_manager.py)
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits for iteration-level scheduling."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # A prefill chunk never takes more than this many tokens of one step's budget, so a
    # long prompt is spread over steps and never stalls the running decodes.
    long_prefill_token_threshold: int = 512
    # Launch step N+1 before reading step N back (worker/engine/inflight.py); None: on
    # for CUDA, where the host's share of a step would leave the GPU idle, off on a CPU
    async_scheduling: bool | None = None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    # multi-LoRA: None = off; the adapters registered at start (name, path)
    lora: LoraConfig | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    # suffix decoding: off unless asked for (worker/engine/speculative/)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # ranks the model is sharded over inside this worker (worker/engine/runner/tp_ranks.py):
    # rank 0 runs the engine, ranks 1..N-1 are processes it spawns; 1: one process
    tensor_parallel_size: int = 1
    # seconds a collective waits for the other ranks: a rank that hangs ends the worker
    # within this bound
    tensor_parallel_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        if not self.tensor_parallel_timeout_s > 0:
            raise ValueError(f"tensor_parallel_timeout_s must be > 0, "
                             f"got {self.tensor_parallel_timeout_s!r}")

    @classmethod
    def create(cls, model: str, **kwargs: object) -> EngineConfig:
        """Build from flat keyword arguments (the ``LLM(...)`` and CLI surface)."""
        groups: dict[str, dict[str, object]] = {"model": {}, "cache": {}, "scheduler": {}}
        top: dict[str, object] = {}
        lora: dict[str, object] = {}
        spec: dict[str, object] = {}
        fields = {
            "model": ModelConfig.__dataclass_fields__,
            "cache": CacheConfig.__dataclass_fields__,
            "scheduler": SchedulerConfig.__dataclass_fields__,
        }
        for key, value in kwargs.items():
            if value is None and key not in ("num_blocks", "memory_bytes", "max_model_len",
                                             "host_memory_bytes"):
                continue
            target = next((g for g, f in fields.items() if key in f), None)
            if key == "kv_cache_blocks":
                groups["cache"]["num_blocks"] = value
            elif key in ("seed", "enable_lora", "lora_modules", "tensor_parallel_size",
                         "tensor_parallel_timeout_s"):
                top[key] = value
            elif key in ("speculative", "spec_max_batch") or (
                    key in SpeculativeConfig.__dataclass_fields__ and key != "method"):
                spec[key] = value
            elif key in LoraConfig.__dataclass_fields__:
                lora[key] = value
            elif target is None:
                raise TypeError(f"unknown engine option: {key!r}")
            else:
                groups[target][key] = value
        modules = _lora_modules(top.pop("lora_modules", ()))
        if top.pop("enable_lora", False) or lora or modules:
            top["lora"] = LoraConfig(**lora)  # type: ignore[arg-type]
            top["lora_modules"] = modules
        if spec:
            top["speculative"] = _speculative(spec)
        return cls(
            model=ModelConfig(model=model, **groups["model"]),  # type: ignore[arg-type]
            cache=CacheConfig(**groups["cache"]),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(**groups["scheduler"]),  # type: ignore[arg-type]
            **top,  # type: ignore[arg-type]
        )

    @classmethod
    def from_env(cls, model: str | None = None, env: dict[str, str] | None = None,
                 **flags: object) -> EngineConfig:
        """The ``FERRY_*`` variables (the names in docs/operations.md) as options, with
        ``flags`` (the ``create`` options a command line gave; None: not given) on top.

        A setting neither names keeps its dataclass default: the one place it is set.
        """
        options = env_options(dict(os.environ if env is None else env))
        options.update({key: value for key, value in flags.items() if value is not None})
        model = model or str(options.pop("model", "") or "") or _default_model()
        options.pop("model", None)
        return cls.create(model, **options)

    def with_model(self, model: str) -> EngineConfig:
        return replace(self, model=replace(self.model, model=model))


def env_options(env: dict[str, str]) -> dict[str, object]:
    """The ``create`` options the ``FERRY_*`` variables in ``env`` set (unset: absent)."""

    def _int(name: str) -> int | None:
        raw = env.get(name)
        return int(raw) if raw not in (None, "") else None

    def _float(name: str) -> float | None:
        raw = env.get(name)
        return float(raw) if raw not in (None, "") else None

    def _bool(name: str) -> bool | None:
        raw = env.get(name, "").strip().lower()
        if raw in ("", "auto"):
            return None
        if raw not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(f"{name} must be 1 or 0, got {raw!r}")
        return raw in ("1", "true", "yes", "on")

    options: dict[str, object | None] = dict(
        model=env.get("FERRY_MODEL") or None,
        dtype=env.get("FERRY_DTYPE"),
        device=env.get("FERRY_DEVICE"),
        attention_backend=env.get("FERRY_ATTENTION_BACKEND"),
        pack_weights=_bool("FERRY_PACK_WEIGHTS"),
        packed_gemv_rows=_gemv_rows(env.get("FERRY_PACKED_GEMV_ROWS")),
        enforce_eager=_bool("FERRY_ENFORCE_EAGER"),
        lean_decode=_bool("FERRY_LEAN_DECODE"),
        quantization=env.get("FERRY_QUANTIZATION") or None,
        max_model_len=_int("FERRY_MAX_MODEL_LEN"),
        block_size=_int("FERRY_BLOCK_SIZE"),
        num_blocks=_int("FERRY_KV_CACHE_BLOCKS"),
        memory_bytes=_int("FERRY_KV_CACHE_BYTES"),
        host_memory_bytes=_int("FERRY_KV_HOST_BYTES"),
        kv_cache_dtype=env.get("FERRY_KV_CACHE_DTYPE"),
        enable_prefix_caching=_bool("FERRY_PREFIX_CACHING"),
        max_num_seqs=_int("FERRY_MAX_NUM_SEQS"),
        tensor_parallel_size=_int("FERRY_TENSOR_PARALLEL_SIZE"),
        tensor_parallel_timeout_s=_float("FERRY_TENSOR_PARALLEL_TIMEOUT_S"),
        max_num_batched_tokens=_int("FERRY_MAX_NUM_BATCHED_TOKENS"),
        async_scheduling=_bool("FERRY_ASYNC_SCHEDULING"),
        enable_lora=_bool("FERRY_ENABLE_LORA"),
        max_loras=_int("FERRY_MAX_LORAS"),
        max_lora_rank=_int("FERRY_MAX_LORA_RANK"),
        max_cpu_loras=_int("FERRY_MAX_CPU_LORAS"),
        lora_modules=env.get("FERRY_LORA_MODULES") or None,
        speculative=env.get("FERRY_SPECULATIVE") or None,
        num_speculative_tokens=_int("FERRY_NUM_SPECULATIVE_TOKENS"),
        spec_max_batch=_int("FERRY_SPEC_MAX_BATCH"),
        store_tokens=_int("FERRY_SPEC_STORE_TOKENS"),
        store_ttl_s=store_ttl_setting(env.get("FERRY_SPEC_STORE_TTL_S")),
    )
    return {key: value for key, value in options.items() if value is not None}


def _speculative(options: dict[str, object]) -> SpeculativeConfig:
    """``speculative`` (a method name or a ``SpeculativeConfig``) and its other options
    (``spec_max_batch`` is ``max_batch_rows``)."""
    base = options.pop("speculative", "off")
    if "spec_max_batch" in options:
        options["max_batch_rows"] = options.pop("spec_max_batch")
    if isinstance(base, SpeculativeConfig):
        return replace(base, **options)  # type: ignore[arg-type]
    return SpeculativeConfig(method=base, **options)  # type: ignore[arg-type]


def _lora_modules(value: object) -> tuple[tuple[str, str], ...]:
    """``NAME=PATH`` pairs (vLLM's ``--lora-modules``): a comma- or space-separated string,
    or a sequence of strings or (name, path) pairs."""
    if isinstance(value, str):
        value = value.replace(",", " ").split()
    pairs = []
    for item in value or ():  # type: ignore[attr-defined]
        if isinstance(item, str):
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"a LoRA module is NAME=PATH, got {item!r}")
            item = (name.strip(), path.strip())
        name, path = item
        pairs.append((str(name), str(path)))
    return tuple(pairs)


def _gemv_rows(raw: str | None) -> int | None:
    """``FERRY_PACKED_GEMV_ROWS``: unset or ``auto`` (measured at load), else rows >= 0."""
    if raw is None or raw.strip().lower() in ("", "auto"):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"FERRY_PACKED_GEMV_ROWS must be auto or an integer >= 0, "
                         f"got {raw!r}") from None


def _default_model() -> str:
    from worker.models import default_model_path

    return default_model_path()

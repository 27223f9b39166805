"""``ferry worker``: serve a model from the Redis request stream.

Every flag can also be set by a ``FERRY_*`` variable (the flag name upper-cased, dashes
to underscores), which is how docker-compose and Kubernetes configure workers. Only typer
is imported at module level; torch loads when the command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def _opt(env: str, help: str | None = None, *flags: str) -> typer.models.OptionInfo:
    return typer.Option(*flags, envvar=env, help=help)  # type: ignore[no-any-return]


Model = Annotated[str | None, _opt("FERRY_MODEL", "Checkpoint dir or hub id (default: the "
                                   "embedded model).")]
RedisUrl = Annotated[str, _opt("FERRY_REDIS_URL")]
WorkerId = Annotated[str | None, _opt("FERRY_WORKER_ID", "Consumer name (default: "
                                      "host-pid-random).")]
Prefix = Annotated[str, _opt("FERRY_PREFIX", "Redis key prefix.")]
ModelName = Annotated[str | None, typer.Option(
    "--served-model-name", "--model-name", envvar=["FERRY_SERVED_MODEL_NAME", "FERRY_MODEL_NAME"],
    help="The model's name in heartbeats, /v1/models and responses; requests naming another "
    "model get 404 (default: the model's directory name).")]
MetricsPort = Annotated[int, _opt("FERRY_METRICS_PORT", "Prometheus port (0: off); when "
                                  "taken, the next free one (logged, in the heartbeat).")]
HealthFile = Annotated[str | None, _opt(
    "FERRY_HEALTH_FILE", "Touched after every heartbeat written, for container health "
    "checks (its age says whether the worker is live).")]
MetricsHost = Annotated[str, _opt("FERRY_METRICS_HOST", "Prometheus bind address (0.0.0.0: "
                                  "every interface, for scrapers on other hosts).")]
MaxNumSeqs = Annotated[int | None, _opt("FERRY_MAX_NUM_SEQS", "Requests in the batch.")]
KvBlocks = Annotated[int | None, _opt("FERRY_KV_CACHE_BLOCKS", "KV cache size in blocks.")]
Device = Annotated[str | None, _opt("FERRY_DEVICE", "auto, cpu, cuda, cuda:N")]
LeaseS = Annotated[float, _opt("FERRY_LEASE_S", "Idle seconds before others may reclaim "
                               "an entry.")]
MaxDeliveries = Annotated[int, _opt("FERRY_MAX_DELIVERIES", "Deliveries before an entry is "
                                    "dead-lettered.")]
DeadMaxLen = Annotated[int, _opt("FERRY_DEAD_LETTER_MAX_LEN", "Dead letters kept per stream "
                                 "(the oldest go first).")]
DeadMaxAgeS = Annotated[float, _opt("FERRY_DEAD_LETTER_MAX_AGE_S", "Seconds a dead letter is "
                                    "kept.")]
DeadMaxPayload = Annotated[int, _opt(
    "FERRY_DEAD_LETTER_MAX_PAYLOAD_BYTES", "A dead letter's payload over this is kept as "
    "its first bytes and its size.")]
DrainS = Annotated[float, _opt("FERRY_DRAIN_TIMEOUT_S", "SIGTERM: seconds to finish "
                               "in-flight requests before handing them back.")]
HeartbeatS = Annotated[float, _opt("FERRY_HEARTBEAT_INTERVAL_S")]
HeartbeatTtlS = Annotated[float, _opt(
    "FERRY_HEARTBEAT_TTL_S", "Seconds a worker counts as live after its last heartbeat; "
    "then others take over its requests (>= 2 heartbeat intervals).")]
Prefetch = Annotated[int, _opt("FERRY_PREFETCH", "Entries held beyond the running batch; "
                               "small, so a burst spreads over idle workers.")]
TorchThreads = Annotated[int | None, _opt("FERRY_TORCH_THREADS", "torch.set_num_threads.")]
Backend = Annotated[str | None, _opt(
    "FERRY_ATTENTION_BACKEND", "auto, cpu (C++ decode kernel), torch, triton.")]
LogLevel = Annotated[str, _opt("FERRY_LOG_LEVEL")]
RedisCluster = Annotated[bool, _opt("FERRY_REDIS_CLUSTER", "Redis Cluster: --redis-url names "
                                    "any node (database 0).")]
StreamShards = Annotated[int, _opt("FERRY_STREAM_SHARDS", "Cluster: request-stream shards (the "
                                  "same on every gateway and worker; docs/operations.md).")]
WaitReplicas = Annotated[int, _opt("FERRY_REDIS_WAIT_REPLICAS", "Cluster: replicas that must "
                                   "have a terminal event before its entry is acknowledged.")]
Lora = Annotated[list[str] | None, _opt(
    "FERRY_LORA_MODULES", "NAME=PATH: a LoRA adapter served as model NAME (repeatable; "
    "enables LoRA).", "--lora")]
LoraRoots = Annotated[str | None, _opt(
    "FERRY_LORA_ROOTS", "Comma-separated directories that adapters loaded at run time "
    "(/v1/load_lora_adapter, FERRY_LORA_DIR) must lie in, symlinks resolved (default: "
    "--lora-dir alone; neither: no loading by path at run time).")]
LoraDir = Annotated[str | None, _opt(
    "FERRY_LORA_DIR", "The gateway's FERRY_LORA_DIR (the same volume): an adapter root "
    "when --lora-roots is not given.")]
Speculative = Annotated[str | None, _opt(
    "FERRY_SPECULATIVE", "suffix: speculative decoding, drafts from the request's own text "
    "and past outputs (no draft model); off (default).")]
SpecFleet = Annotated[bool, _opt(
    "FERRY_SPEC_FLEET", "With --speculative suffix: share finished outputs with the model's "
    "other workers (a capped Redis stream); off: draft from this worker's own only.",
    "--spec-fleet/--no-spec-fleet")]
SpecFleetEntries = Annotated[int, _opt("FERRY_SPEC_FLEET_ENTRIES", "Outputs the fleet's "
                                       "draft stream keeps (about; the oldest go first).")]
Quantization = Annotated[str | None, _opt(
    "FERRY_QUANTIZATION", "Quantize the checkpoint's weights at load: fp8 (W8A8), int8 or "
    "int4 (weight-only); a quantized checkpoint (compressed-tensors, ModelOpt, AWQ, GPTQ) "
    "is read as it is without it.")]
WaitTimeoutMs = Annotated[int, _opt("FERRY_REDIS_WAIT_TIMEOUT_MS", "Cluster: WAIT timeout.")]
OutputProc = Annotated[bool, _opt(
    "FERRY_OUTPUT_PROCESS", "Detokenize, build events and write them to Redis in a second "
    "process, off the engine's GIL (default); --no-output-process: in the engine's own.",
    "--output-process/--no-output-process")]
EnableLora = Annotated[bool | None, _opt(
    "FERRY_ENABLE_LORA", "LoRA on without adapters at start, for /v1/load_lora_adapter.",
    "--enable-lora/--no-enable-lora")]
MaxLoras = Annotated[int | None, _opt("FERRY_MAX_LORAS", "Adapters on the device at once.")]
MaxLoraRank = Annotated[int | None, _opt("FERRY_MAX_LORA_RANK", "Largest adapter rank "
                                         "accepted.")]
TensorParallelSize = Annotated[int | None, _opt(
    "FERRY_TENSOR_PARALLEL_SIZE", "Shard the model over this many ranks (processes, one "
    "device each on CUDA) inside this worker; docs/tensor-parallel.md.")]
OutputHangS = Annotated[float, _opt(
    "FERRY_OUTPUT_HANG_S", "An output process that answers nothing for this long (stopped, "
    "deadlocked) is killed and the worker exits 71, as when it dies.")]


def _name_for(model: str) -> str:
    """Name advertised in heartbeats (``/v1/models``): a hub id as is, a directory's name."""
    path = Path(model)
    return path.name if path.exists() else model


def worker(
    model: Model = None, redis_url: RedisUrl = "redis://localhost:6379/0",
    worker_id: WorkerId = None, prefix: Prefix = "ferry", model_name: ModelName = None,
    metrics_port: MetricsPort = 0, metrics_host: MetricsHost = "127.0.0.1",
    max_num_seqs: MaxNumSeqs = None,
    kv_cache_blocks: KvBlocks = None, device: Device = None, lease_s: LeaseS = 30.0,
    max_deliveries: MaxDeliveries = 3, drain_timeout_s: DrainS = 30.0,
    dead_letter_max_len: DeadMaxLen = 10_000, dead_letter_max_age_s: DeadMaxAgeS = 604800.0,
    dead_letter_max_payload_bytes: DeadMaxPayload = 8192,
    heartbeat_interval_s: HeartbeatS = 1.0, heartbeat_ttl_s: HeartbeatTtlS = 4.0,
    prefetch: Prefetch = 4, health_file: HealthFile = None,
    torch_threads: TorchThreads = None,
    attention_backend: Backend = None, log_level: LogLevel = "info",
    redis_cluster: RedisCluster = False, stream_shards: StreamShards = 3,
    redis_wait_replicas: WaitReplicas = 1, redis_wait_timeout_ms: WaitTimeoutMs = 2000,
    lora: Lora = None, lora_roots: LoraRoots = None, lora_dir: LoraDir = None,
    speculative: Speculative = None, spec_fleet: SpecFleet = True,
    spec_fleet_entries: SpecFleetEntries = 4096, output_process: OutputProc = True,
    output_hang_s: OutputHangS = 5.0, quantization: Quantization = None,
    enable_lora: EnableLora = None,
    max_loras: MaxLoras = None, max_lora_rank: MaxLoraRank = None,
    tensor_parallel_size: TensorParallelSize = None,
) -> None:
    """Run one worker: pull requests, batch them on the engine, stream tokens back."""
    from protocol.cluster.nodes import Replication
    from protocol.dead_letters import DeadLetterBounds
    from protocol.lora.paths import adapter_roots, parse_roots
    from protocol.store import Ttls
    from worker.engine.config import EngineConfig
    from worker.service.main import run_worker
    from worker.service.redis.connection import WorkerSettings, default_worker_id

    try:  # the flags over the FERRY_* variables the engine has no flag for
        config = EngineConfig.from_env(
            model, device=device, max_num_seqs=max_num_seqs, num_blocks=kv_cache_blocks,
            attention_backend=attention_backend, lora_modules=lora or None,
            speculative=speculative, enable_lora=enable_lora, max_loras=max_loras,
            max_lora_rank=max_lora_rank, quantization=quantization,
            tensor_parallel_size=tensor_parallel_size,
        )
        if config.tensor_parallel_size > 1:  # devices, heads, features: before any load
            from worker.engine.runner.tp_checks import check_tensor_parallel

            check_tensor_parallel(config)
        settings = WorkerSettings(
            redis_url=redis_url, prefix=prefix, worker_id=worker_id or default_worker_id(),
            model_name=model_name or _name_for(config.model.model), lease_s=lease_s,
            max_deliveries=max_deliveries, drain_timeout_s=drain_timeout_s,
            heartbeat_interval_s=heartbeat_interval_s, metrics_port=metrics_port,
            prefetch=prefetch, ttls=Ttls(heartbeat_s=heartbeat_ttl_s), health_file=health_file,
            redis_cluster=redis_cluster, stream_shards=stream_shards,
            replication=Replication(redis_wait_replicas, redis_wait_timeout_ms),
            metrics_host=metrics_host, spec_fleet=spec_fleet,
            spec_fleet_entries=spec_fleet_entries, output_process=output_process,
            lora_roots=adapter_roots(parse_roots(lora_roots), lora_dir),
            output_hang_s=output_hang_s,
            dead_letters=DeadLetterBounds(dead_letter_max_len, dead_letter_max_age_s,
                                          dead_letter_max_payload_bytes),
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError too
        raise typer.BadParameter(str(exc)) from exc
    raise typer.Exit(run_worker(config, settings, torch_threads=torch_threads,
                                log_level=log_level))

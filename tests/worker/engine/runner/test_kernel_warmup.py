"""The start-up warm-up compiles every Triton variant that serving launches (no compile
stall mid-batch), and a kernel that fails there leaves the worker on torch attention,
degraded and saying so; a device fault there is not swallowed.

Launches are recorded under the interpreter as the variants a GPU would compile
(``triton_launches.py``), so this is checked on the CPU.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.worker.engine.triton_launches import recorded_launches
from worker import Engine, EngineConfig
from worker.engine.output.text_output import TextOutputs
from worker.engine.runner import warmup
from worker.engine.runner.warmup import warm_up_kernels


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    # head_dim 16, like real models a multiple of 16 (with 8, a one-token step has strides
    # of another 16-divisibility than a batch, an artefact of the tiny shape)
    return build_checkpoint("llama", tmp_path_factory.mktemp("warmup"), hidden=64)


def _engine(path: str) -> Engine:
    return Engine(EngineConfig.create(
        path, device="cpu", num_blocks=60, block_size=8, max_num_seqs=5,
        max_num_batched_tokens=48, long_prefill_token_threshold=24, attention_backend="triton"))


def _serve(engine: Engine) -> None:
    """Prompts of 1 to 70 tokens arriving while others decode: single-sequence prefills,
    chunked prefills, odd numbers of decodes ahead of a chunk, pure-decode steps."""
    rng = random.Random(11)
    vocab = engine.runner.shape.vocab_size
    for i, plen in enumerate([1, 70, 3, 17, 33, 2, 9, 64, 5]):
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(plen)],
                           SamplingParams(temperature=0, max_tokens=3 + i % 4, ignore_eos=True))
        for _ in range(i % 3):
            TextOutputs.of(engine).step()
    while engine.has_unfinished_requests():
        TextOutputs.of(engine).step()


def test_warm_up_compiles_every_variant_serving_launches(
        ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(ckpt)
    with recorded_launches(monkeypatch) as log:
        log.phase = "warm_up"
        warm_up_kernels(engine.runner)
        log.phase = "serving"
        _serve(engine)
    served = log.variants("serving")
    assert {v[0] for v in served} >= {"_prefill_kernel", "_decode_split_kernel",
                                      "_store_kv_kernel"}
    assert served <= log.variants("warm_up"), served - log.variants("warm_up")
    assert engine.runner.backend.name == "triton" and engine.stats().degraded == ()


class _Failing:
    def __init__(self, message: str) -> None:
        self.message = message

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(self.message)

        return launch


def test_a_kernel_that_fails_to_compile_leaves_torch_attention_and_a_loud_mark(
        ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _generate(_engine(ckpt))
    engine = _engine(ckpt)  # the warm-up writes into free blocks: only ever at start
    from kernels import prefill_attention

    with monkeypatch.context() as patch:
        patch.setattr(prefill_attention, "_prefill_kernel",
                      _Failing("PTXASError: ptxas failed with error code 255 (simulated)"))
        warm_up_kernels(engine.runner)
    assert engine.runner.backend.name == "torch"
    assert engine.stats().degraded == ("attention_kernel_failed",)
    assert _generate(engine) == reference  # slower, still right


def test_a_device_fault_during_warm_up_is_raised(
        ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(ckpt)
    from kernels import prefill_attention

    monkeypatch.setattr(prefill_attention, "_prefill_kernel",
                        _Failing("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        warmup.warm_up_kernels(engine.runner)
    assert engine.stats().degraded == ()


def _generate(engine: Engine) -> list[list[int]]:
    """Greedy tokens of two prompts (ids taken from a counter: callable more than once)."""
    first = engine.stats().steps
    ids = [f"g{first}-{k}" for k in range(2)]
    for rid, prompt in zip(ids, ["def add(a, b):", "class Queue:"], strict=True):
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=6,
                                                       ignore_eos=True))
    outs: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            outs[out.request_id] += out.new_token_ids
    return [outs[rid] for rid in ids]


def _as_if_on_cuda(engine: Engine) -> Any:
    """The engine's runner as warm_up_sampling sees it on a GPU (the build is stubbed)."""
    import torch

    runner = engine.runner
    return type("CudaRunner", (), dict(device=torch.device("cuda"), loaded=runner.loaded,
                                        shape=runner.shape, health=runner.health))()


def test_a_sampling_kernel_that_fails_to_build_leaves_its_torch_twin_and_a_loud_mark(
        ckpt: str) -> None:
    engine = _engine(ckpt)

    def fails(*_: object) -> None:  # what Triton 3.6 raised on the H200
        raise RuntimeError("PassManager::run failed (simulated)")

    warmup.warm_up_sampling(_as_if_on_cuda(engine), engine.sampler, build=fails)
    assert engine.sampler.fused is False
    assert engine.stats().degraded == ("sampling_kernel_failed",)
    outs = _generate(engine)
    assert all(len(o) == 6 for o in outs)


def test_a_device_fault_while_building_the_sampling_kernel_is_raised(ckpt: str) -> None:
    engine = _engine(ckpt)

    def faults(*_: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        warmup.warm_up_sampling(_as_if_on_cuda(engine), engine.sampler, build=faults)
    assert engine.sampler.fused is True and engine.stats().degraded == ()


def test_the_sampling_warm_up_launches_both_variants(ckpt: str) -> None:
    """The real build (here under the interpreter): the model's dtype, and float32 with a
    logit bias."""
    import torch

    engine = _engine(ckpt)
    warmup._build_sampling(torch.device("cpu"), torch.bfloat16, engine.runner.shape.vocab_size)
    assert engine.stats().degraded == ()

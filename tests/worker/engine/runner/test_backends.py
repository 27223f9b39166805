"""Every attention backend produces the same tokens through the whole engine.

The Triton kernels run under ``TRITON_INTERPRET=1`` here (tests/conftest.py), so this
checks the engine's use of them — metadata, slicing, output placement — on CPU. The
workload chunks prompts (so prefills attend over a cached prefix) and preempts.
"""

from __future__ import annotations

import random

import pytest

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from worker import Engine, EngineConfig
from worker.engine.output.text_output import TextOutputs
from worker.engine.runner.attention.interface import triton_interpreting


def run(path: str, **kw: object) -> dict[str, list[int]]:
    engine = Engine(EngineConfig.create(
        path, device="cpu", num_blocks=24, block_size=8, max_num_seqs=4,
        max_num_batched_tokens=32, long_prefill_token_threshold=16, **kw,
    ))
    rng = random.Random(3)
    vocab = engine.runner.shape.vocab_size
    for i, plen in enumerate([1, 5, 20, 37, 9, 3]):
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(plen)],
                           SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True))
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # Mistral: a sliding window (48) shorter than the longest context.
    return build_checkpoint("mistral", tmp_path_factory.mktemp("backends"), hidden=32)


@pytest.fixture(scope="module")
def torch_tokens(ckpt):
    return run(ckpt, attention_backend="torch")


def test_triton_backend_matches_torch(ckpt, torch_tokens):
    if not triton_interpreting():  # e.g. a GPU machine: tests/kernels cover the kernels there
        pytest.skip("the Triton backend runs on the CPU only under TRITON_INTERPRET=1")
    assert run(ckpt, attention_backend="triton") == torch_tokens


def test_triton_on_the_cpu_without_the_interpreter_is_refused_at_load(ckpt, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend 'triton' runs on a CUDA device"):
        run(ckpt, attention_backend="triton")


def test_cpu_kernel_backend_matches_torch(ckpt, torch_tokens):
    assert run(ckpt, attention_backend="cpu") == torch_tokens


def test_cpu_kernel_reads_a_bf16_cache_like_torch(ckpt):
    want = run(ckpt, attention_backend="torch", kv_cache_dtype="bfloat16")
    assert run(ckpt, attention_backend="cpu", kv_cache_dtype="bfloat16") == want


def test_auto_is_the_cpu_kernel_on_cpu(ckpt):
    engine = Engine(EngineConfig.create(ckpt, device="cpu", num_blocks=8))
    assert engine.runner.backend.name == "cpu"


def test_cpu_backend_without_compiler_is_a_clear_error(ckpt, monkeypatch, tmp_path):
    from kernels import cpu_decode_attention

    cpu_decode_attention._kernel.cache_clear()
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("FERRY_KERNEL_CACHE", str(tmp_path))
    try:
        with pytest.raises(ValueError, match="'cpu' is unavailable.*no-such-compiler"):
            Engine(EngineConfig.create(ckpt, device="cpu", attention_backend="cpu"))
        auto = Engine(EngineConfig.create(ckpt, device="cpu", num_blocks=8))
        assert auto.runner.backend.name == "torch"
    finally:
        cpu_decode_attention._kernel.cache_clear()


def test_cpu_backend_refuses_a_gpu_device():
    import torch

    from worker.engine.runner.attention.interface import make_backend

    with pytest.raises(ValueError, match="runs on the CPU"):
        make_backend("cpu", torch.device("cuda"))

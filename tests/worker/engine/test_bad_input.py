"""Bad input gets a clear error naming the problem, and other requests are undisturbed."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from worker import LLM, Engine, EngineConfig
from worker.engine.output.text_output import TextOutputs

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("bad"), max_pos=128)


@pytest.fixture(scope="module")
def engine(ckpt):
    return Engine(EngineConfig.create(ckpt, num_blocks=32, block_size=8, device="cpu"))


def run_all(engine: Engine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[1, 10**6]), "prompt_token_ids"),
        (dict(prompt="hi", params=SamplingParams(max_tokens=200)),
         "maximum context length is 128 tokens.*requested 20[0-9] tokens"),
        (dict(prompt=list(range(1, 120)), params=SamplingParams(max_tokens=20)),
         "maximum context length is 128 tokens.*119 in the prompt, 20 in the completion"),
        (dict(prompt="hi", params={"temperature": -1}), "temperature"),
        (dict(prompt="hi", params={"max_tokens": 0}), "max_tokens"),
        (dict(prompt="hi", params={"top_p": 1.5}), "top_p"),
        (dict(prompt="hi", params={"bogus": 1}), "bogus"),
        (dict(prompt=None), "exactly one"),
    ],
)
def test_bad_request_is_refused_and_others_unaffected(engine, kwargs, match):
    engine.add_request("good", [5, 6, 7], GREEDY)
    before = engine.block_manager.num_free_blocks
    with pytest.raises((ValueError, ValidationError), match=match):
        engine.add_request("bad", kwargs.pop("prompt"), kwargs.pop("params", GREEDY))
    assert "bad" not in engine.scheduler.requests
    assert engine.block_manager.num_free_blocks == before
    assert len(run_all(engine)["good"]) == 6


def test_duplicate_request_id(engine):
    engine.add_request("dup", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="already"):
        engine.add_request("dup", [1, 2], GREEDY)
    run_all(engine)


def test_more_blocks_than_the_pool(ckpt):
    small = Engine(EngineConfig.create(ckpt, num_blocks=2, block_size=8, device="cpu"))
    with pytest.raises(ValueError, match="KV blocks"):
        small.add_request("big", list(range(1, 30)), GREEDY)


def test_chat_without_template(ckpt, tmp_path):
    import json
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(ckpt, plain)
    cfg_path = plain / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    eng = Engine(EngineConfig.create(str(plain), num_blocks=8, device="cpu"))
    with pytest.raises(ValueError, match="chat template"):
        eng.add_request("c", None, GREEDY, messages=[{"role": "user", "content": "hi"}])


def test_chat_with_template(engine):
    engine.add_request("chat", None, GREEDY, messages=[{"role": "user", "content": "hi"}])
    assert len(run_all(engine)["chat"]) == 6


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(model="/does/not/exist"), "does not exist"),
        (dict(model="not-a-local-model-name"), "cannot load model config"),
        (dict(block_size=0), "block_size"),
        (dict(kv_cache_blocks=0), "kv_cache_blocks"),
        (dict(dtype="float8"), "dtype"),
        (dict(attention_backend="magic"), "attention_backend"),
        (dict(attention_backend="triton", kv_cache_dtype="bfloat16"),
         "kv_cache_dtype bfloat16 differs from the model's dtype float32"),
        (dict(device="cuda:0"), "CUDA is not available"),
        (dict(model="WEIGHTLESS"), "cannot load model weights"),
    ],
)
def test_bad_engine_options(ckpt, tmp_path, kwargs, match):
    import torch

    if kwargs.get("device", "").startswith("cuda") and torch.cuda.is_available():
        pytest.skip("CUDA present")
    model = kwargs.pop("model", ckpt)
    if model == "WEIGHTLESS":  # a config with no weights beside it
        from transformers import AutoConfig

        model = str(tmp_path)
        AutoConfig.from_pretrained(ckpt).save_pretrained(model)
    with pytest.raises(ValueError, match=match):
        LLM(model, **kwargs)


def test_architecture_we_cannot_serve(tmp_path):
    from transformers import BloomConfig  # attention not behind AttentionInterface

    BloomConfig(n_layer=1, hidden_size=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="cannot be served|no causal-LM"):
        LLM(str(tmp_path))


def test_aborts_and_finishes_return_every_block(engine):
    """1,000 requests finishing or aborted leave the pool all free (no leak)."""
    bm = engine.block_manager
    for wave in range(20):
        for i in range(50):
            rid = f"w{wave}-{i}"
            engine.add_request(rid, [1 + i % 50] * (1 + i % 13),
                               SamplingParams(temperature=0, max_tokens=1 + i % 4, ignore_eos=True))
        TextOutputs.of(engine).step()
        for i in range(0, 50, 3):
            TextOutputs.of(engine).abort(f"w{wave}-{i}")
        run_all(engine)
        assert bm.num_free_blocks == bm.num_blocks
        bm.check_invariants()
    assert not engine.scheduler.requests and not engine.streams.requests
    assert not TextOutputs.of(engine).texts.streams


def test_device_faults_are_told_apart_from_failures_of_one_batch():
    import torch

    from worker.engine.health import is_device_fault

    assert is_device_fault(torch.AcceleratorError("CUDA error: an illegal memory access"))
    assert is_device_fault(RuntimeError("CUDA error: device-side assert triggered"))
    assert is_device_fault(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling gemm"))
    assert not is_device_fault(torch.OutOfMemoryError("CUDA out of memory. Tried to ..."))
    assert not is_device_fault(RuntimeError("CUDA error: out of memory"))
    assert not is_device_fault(RuntimeError("shape '[2, 3]' is invalid for input of size 5"))
    assert not is_device_fault(ValueError("CUDA error: not really"))


def test_a_device_fault_ends_the_step_loop_instead_of_one_batch(ckpt, monkeypatch):
    """Any other failure fails its batch and the engine goes on; a broken device raises."""
    import torch

    from worker.engine.health import DeviceFault

    engine = Engine(EngineConfig.create(ckpt, num_blocks=32, block_size=8, device="cpu"))
    engine.add_request("a", "hello", GREEDY)
    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "execute", lambda *a: (_ for _ in ()).throw(
            RuntimeError("a bug in one forward")))
        (out,) = TextOutputs.of(engine).step()
    assert out.finish_reason == "error" and "a bug" in (out.error or "")
    engine.add_request("b", "hello", GREEDY)
    monkeypatch.setattr(engine.runner, "execute", lambda *a: (_ for _ in ()).throw(
        torch.AcceleratorError("CUDA error: an illegal memory access was encountered")))
    with pytest.raises(DeviceFault, match="illegal memory access"):
        TextOutputs.of(engine).step()

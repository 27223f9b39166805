"""Three adapters and the base model in ONE batch equal transformers running each adapter
merged into the weights (W + scale * B @ A), fp32 on CPU.

Logits: one padded-free forward of four rows through the LoRA-wrapped model (with and
without the oneDNN-packed base projections) against four merged models. Tokens: the
paged Engine decoding eight requests (two per adapter, two on the base model, prompts
long enough to be chunked) against ``generate`` on the merged models; a diverging token
must be a near-tie (top-2 logprob gap < 1e-3), as in test_correctness.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.worker.engine.lora_adapters import ATTN, merged_state, write_adapter
from tests.worker.engine.test_correctness import assert_matches, reference_greedy
from worker import Engine, EngineConfig
from worker.engine.lora import metadata
from worker.engine.lora.config import LoraConfig
from worker.engine.lora.manager import LoraManager
from worker.engine.lora.targets import base_targets
from worker.engine.output.text_output import TextOutputs
from worker.engine.runner.cpu.packed_linear import pack_linears

CFG = LoraConfig(max_loras=4, max_lora_rank=16, max_cpu_loras=4)
# name -> (rank, alpha, targets, rsLoRA); scales 2.0, 8/sqrt(16) = 2.0, 1.0
SPECS = {"all8": (8, 16, None, False), "attn16": (16, 8, ATTN, True),
         "mlp4": (4, 4, ("gate_proj", "up_proj", "down_proj"), False)}


def _load(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[str, dict[str, tuple[str, float]]]:
    """(checkpoint, adapter name -> (path, scale))."""
    root = tmp_path_factory.mktemp("lora")
    path = build_checkpoint("llama", root)
    base = base_targets(_load(path), path)
    adapters = {}
    for seed, (name, (rank, alpha, targets, rs)) in enumerate(SPECS.items(), start=1):
        kwargs = {"targets": targets} if targets else {}
        adapter = write_adapter(root / name, base, rank=rank, alpha=alpha, rslora=rs,
                                seed=seed, std=0.15, **kwargs)
        adapters[name] = (adapter, alpha / (rank ** 0.5 if rs else rank))
    return path, adapters


def _merged(path: str, adapter: tuple[str, float] | None):
    model = _load(path)
    if adapter is not None:
        model.load_state_dict(merged_state(model, *adapter))
    return model


@pytest.mark.parametrize("pack, path_kind", [(False, "wide"), (True, "wide"),
                                              (True, "groups")])
def test_one_forward_matches_merged_logits(setup, pack: bool, path_kind: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``wide``: every slot at once (small steps); ``groups``: one matmul pair per
    adapter (``metadata.WIDE_MAX_TOKENS`` set to 0)."""
    if path_kind == "groups":
        monkeypatch.setattr(metadata, "WIDE_MAX_TOKENS", 0)
    path, adapters = setup
    model = _load(path)
    if pack:
        assert pack_linears(model) > 0
    lora = LoraManager(model, path, CFG, torch.device("cpu"), torch.float32)
    assert lora.wrapped == 2 * 7
    for name, (adapter_path, _) in adapters.items():
        lora.add_adapter(name, adapter_path)
    rows = ["mlp4", None, "all8", "attn16", "mlp4"]  # mlp4's tokens are not contiguous
    for i, name in enumerate(rows):
        if name is not None:
            lora.attach(f"r{i}", name)
    ids = torch.randint(0, model.config.vocab_size, (len(rows), 11),
                        generator=torch.Generator().manual_seed(5))
    lora.begin_step([f"r{i}" for i in range(len(rows))], [ids.shape[1]] * len(rows))
    with torch.inference_mode():
        got = model(input_ids=ids).logits  # [4, L, V]
        lora.end_step()
        base_again = model(input_ids=ids).logits
        for i, name in enumerate(rows):
            want = _merged(path, adapters[name] if name else None)(input_ids=ids[i:i + 1])
            torch.testing.assert_close(got[i], want.logits[0], atol=1e-4, rtol=1e-4)
            if name is not None:  # the adapter matters: far from the base model's logits
                assert (got[i] - base_again[i]).abs().max() > 0.1
    torch.testing.assert_close(base_again[1], got[1], atol=1e-5, rtol=1e-5)


def test_engine_greedy_matches_merged_generate(setup) -> None:
    path, adapters = setup
    cfg = EngineConfig.create(
        path, num_blocks=64, block_size=8, max_num_seqs=8, max_num_batched_tokens=48,
        long_prefill_token_threshold=24, device="cpu", attention_backend="cpu",
    )
    engine = Engine(cfg)
    lora = engine.runner.enable_lora(CFG)
    for name, (adapter_path, _) in adapters.items():
        lora.add_adapter(name, adapter_path)
    rng = random.Random(7)
    vocab = engine.runner.shape.vocab_size
    names = [*adapters, None] * 2
    jobs = [(f"q{i}", name, [rng.randrange(vocab) for _ in range(rng.choice([3, 17, 40]))])
            for i, name in enumerate(names)]
    for rid, name, prompt in jobs:
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=12,
                                                       ignore_eos=True))
        if name is not None:
            lora.attach(rid, name)
    results: dict[str, list[int]] = {rid: [] for rid, _, _ in jobs}
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            results[out.request_id] += out.new_token_ids
            if out.finished:
                lora.detach(out.request_id)
    assert lora.slots.pins == [0] * CFG.max_loras
    for name in [*adapters, None]:
        model = _merged(path, adapters[name] if name else None)
        for rid, job_name, prompt in jobs:
            if job_name == name:
                want, gaps = reference_greedy(model, prompt, 12)
                assert_matches(results[rid], want, gaps, f"{rid} ({name})")
    base_model = _merged(path, None)
    differ = sum(results[rid] != reference_greedy(base_model, prompt, 12)[0]
                 for rid, name, prompt in jobs if name is not None)
    assert differ >= 4, "the adapters should change most greedy outputs"


def test_bad_adapter_changes_nothing(setup, tmp_path: Path) -> None:
    from worker.engine.lora.adapter import LoraError

    path, adapters = setup
    lora = LoraManager(_load(path), path, CFG, torch.device("cpu"), torch.float32)
    lora.add_adapter("good", adapters["all8"][0])
    with pytest.raises(LoraError, match="max_lora_rank=16"):
        lora.add_adapter("big", write_adapter(tmp_path / "big", lora.cache.targets, rank=32))
    assert lora.adapters() == ["good"]
    with pytest.raises(KeyError):
        lora.attach("r", "big")

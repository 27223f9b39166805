"""MoE layers through Ferry's experts path equal transformers' per-expert modules (fp32, CPU).

Modules: every experts module of tiny Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE checkpoints,
and gpt-oss's (biased, transposed, clamped gate), on routings with experts nobody chose
and one token, through ``experts_forward`` against the module's eager forward. Engine:
greedy requests through the paged engine (which loads with Ferry's experts) against
``generate`` with ``experts_implementation="eager"``: the same tokens (a divergence only
at a near-tie) and the chosen tokens' logprobs within 1e-4.
"""

from __future__ import annotations

import random

import pytest
import torch

from protocol.sampling import SamplingParams
from tests.checkpoints import MOE_ARCHS, build_checkpoint
from tests.worker.engine.test_correctness import assert_matches
from worker import Engine, EngineConfig
from worker.engine.output.text_output import TextOutputs
from worker.engine.runner import moe


def _eager(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager").eval()


def _routings(experts: int, top_k: int, gen: torch.Generator):
    """(name, ids [T, K]): a batch, one token, and a batch that leaves experts unchosen."""
    def pick(tokens: int, pool: int) -> torch.Tensor:
        return torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(tokens)])
    return [("batch", pick(11, experts)), ("one_token", pick(1, experts)),
            ("empty_experts", pick(6, max(top_k, experts // 2)))]


def _check_module(module, top_k: int, hidden: int) -> None:
    experts = module.down_proj.shape[0]
    gen = torch.Generator().manual_seed(experts * 10 + top_k)
    for name, ids in _routings(experts, top_k, gen):
        x = torch.randn(ids.shape[0], hidden, generator=gen)
        w = torch.softmax(torch.randn(ids.shape, generator=gen), -1)
        want = type(module).forward.__wrapped__(module, x, ids, w)  # the eager loop
        got = moe.experts_forward(module, x, ids, w)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_experts_modules_match_eager(arch, tmp_path_factory) -> None:
    model = _eager(build_checkpoint(arch, tmp_path_factory.mktemp(arch)))
    modules = [m for m in model.modules() if moe.is_experts_module(m)]
    assert len(modules) == model.config.num_hidden_layers
    assert all(moe.fused_layout(m) for m in modules)  # these take the Triton kernel on CUDA
    top_k = model.config.num_experts_per_tok
    with torch.no_grad():
        for m in modules:
            _check_module(m, top_k, model.config.hidden_size)


def test_gpt_oss_experts_take_the_grouped_path() -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=6,
                       num_experts_per_tok=2)
    torch.manual_seed(0)
    module = GptOssExperts(cfg)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.5)  # large enough that the swiglu clamp bites
        assert not moe.fused_layout(module)
        _check_module(module, 2, 32)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_engine_greedy_matches_module_path(arch, tmp_path_factory) -> None:
    path = build_checkpoint(arch, tmp_path_factory.mktemp(arch))
    engine = Engine(EngineConfig.create(
        path, num_blocks=48, block_size=8, max_num_seqs=8, max_num_batched_tokens=48,
        device="cpu", attention_backend="cpu"))
    assert engine.runner.model.config._experts_implementation == moe.IMPLEMENTATION
    rng = random.Random(len(arch))
    vocab = engine.runner.shape.vocab_size
    jobs = [(f"{arch}-{i}", [rng.randrange(vocab) for _ in range(plen)], mt)
            for i, (plen, mt) in enumerate([(1, 6), (9, 12), (33, 8), (70, 10), (5, 16)])]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=0)
    for rid, prompt, mt in jobs:
        engine.add_request(rid, prompt, params.model_copy(update={"max_tokens": mt}))
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in jobs}
    lps: dict[str, list[float]] = {rid: [] for rid, _, _ in jobs}
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            tokens[out.request_id] += out.new_token_ids
            lps[out.request_id] += [lp[0] for lp in out.logprobs or []]
    ref = _eager(path)
    ref.generation_config.eos_token_id = None  # like ignore_eos, without masking EOS
    for rid, prompt, mt in jobs:
        ids = torch.tensor([prompt])
        gen = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=mt,
                           do_sample=False, output_scores=True,
                           return_dict_in_generate=True, pad_token_id=0)
        want = gen.sequences[0, len(prompt):].tolist()
        logp = [torch.log_softmax(s[0].float(), -1) for s in gen.scores]
        gaps = [float(lp.topk(2).values[0] - lp.topk(2).values[1]) for lp in logp]
        assert_matches(tokens[rid], want, gaps, rid)
        same = next((i for i, (a, b) in enumerate(zip(tokens[rid], want, strict=True))
                     if a != b), len(want))
        for i in range(same):
            assert abs(lps[rid][i] - float(logp[i][want[i]])) < 1e-4, (rid, i)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_fused_kernel_on_real_modules(arch, tmp_path_factory, monkeypatch) -> None:
    """The Triton kernel (interpreted on the CPU) through the same entry, on the modules'
    own weights and layout, against their eager forward."""
    import os

    if os.environ.get("TRITON_INTERPRET", "") in ("", "0"):
        pytest.skip("the Triton kernel needs a GPU or TRITON_INTERPRET=1 (ops/test.sh sets it)")
    monkeypatch.setattr(moe, "takes_fused_kernel", lambda hidden, module: moe.fused_layout(module))
    model = _eager(build_checkpoint(arch, tmp_path_factory.mktemp(arch)))
    module = next(m for m in model.modules() if moe.is_experts_module(m))
    with torch.no_grad():
        _check_module(module, model.config.num_experts_per_tok, model.config.hidden_size)

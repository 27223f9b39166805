"""What vLLM users send beyond sampling (issue 27, items 11 and 13), on the engine: bad
words (vLLM's derivation and rule, on the device), allowed token ids, prompt truncation,
the chat template's switches and variables, fill-in-the-middle, and ``stop_reason``.

Greedy runs are on the default model: a ban must never let its word through, and where no
ban applies the output must be plain greedy, token for token.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from protocol.sampling import SamplingParams
from tests.checkpoints import FIM_TOKENS, build_tokenizer
from worker import LLM, Engine, EngineConfig
from worker.engine.inputs.bad_words import word_token_ids
from worker.engine.inputs.prompts import PromptBuilder, PromptError, PromptLimits, PromptOptions
from worker.engine.output.text_output import TextOutputs
from worker.engine.sample.logits_processors import apply_bad_words
from worker.engine.sample.sampler import SamplingRow
from worker.models import default_model_path

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def llm() -> LLM:
    torch.set_num_threads(1)
    return LLM(device="cpu", kv_cache_blocks=256)


@pytest.fixture(scope="module")
def plain(llm: LLM) -> list[int]:
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32))[0].token_ids


def _greedy(llm: LLM, **kw: Any) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=32, **kw)
    return llm.generate(PROMPT, params)[0].token_ids


def _contains(ids: list[int], seq: tuple[int, ...]) -> int:
    """Where ``seq`` first occurs in ``ids`` (its start), or -1."""
    return next((i for i in range(len(ids) - len(seq) + 1)
                 if tuple(ids[i:i + len(seq)]) == seq), -1)


def _word_in(tok: Any, plain: list[int], length: int) -> tuple[str, tuple[int, ...], int]:
    """A word whose derived sequence of ``length`` tokens occurs in ``plain``: (word, that
    sequence, where it first occurs)."""
    for i in range(len(plain) - length + 1):
        word = tok.decode(plain[i:i + length])
        seq = tuple(plain[i:i + length])
        if word.strip() and seq in word_token_ids(tok, [word]):
            return word, seq, _contains(plain, seq)
    raise AssertionError(f"no {length}-token word in {plain}")


@pytest.mark.parametrize("length", [1, 2])
def test_bad_words_never_generated_and_greedy_elsewhere(llm: LLM, plain: list[int],
                                                        length: int) -> None:
    word, seq, first = _word_in(llm.tokenizer, plain, length)
    banned = word_token_ids(llm.tokenizer, [word])
    out = _greedy(llm, bad_words=[word])
    assert all(_contains(out, s) == -1 for s in banned), (word, banned, out)
    # plain greedy up to the ban's first use; a longer word's first tokens stay allowed
    assert out[:first + length - 1] == plain[:first + length - 1]
    assert out != plain


def test_bad_words_that_never_apply_change_nothing(llm: LLM, plain: list[int]) -> None:
    words = ["zebra", "Quokka marsupial"]
    assert all(_contains(plain, s) == -1 for s in word_token_ids(llm.tokenizer, words))
    assert _greedy(llm, bad_words=words) == plain


def test_bad_words_with_overlapped_steps(plain: list[int]) -> None:
    """A multi-token word reads the output on the host: with overlap on, the previous
    step is read back first, and the result is the one without overlap."""
    torch.set_num_threads(1)
    config = EngineConfig.create(default_model_path(), device="cpu", num_blocks=256,
                                 async_scheduling=True)
    engine = Engine(config)
    word, seq, _ = _word_in(engine.tokenizer, plain, 2)
    ids: list[int] = []
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=32,
                                                   bad_words=[word]))
    while engine.has_unfinished_requests():
        ids += [t for out in TextOutputs.of(engine).step() for t in out.new_token_ids]
    assert _contains(ids, seq) == -1
    assert engine.overlap


def _reference_bans(logits: torch.Tensor, words: list[list[tuple[int, ...]]],
                    outputs: list[list[int]]) -> torch.Tensor:
    """vLLM's loop (v1 ``apply_bad_words``), row by row."""
    logits = logits.clone()
    for row, (sequences, past) in enumerate(zip(words, outputs, strict=True)):
        for seq in sequences:
            if len(seq) > len(past) + 1:
                continue
            prefix = len(seq) - 1
            if list(past[len(past) - prefix:] if prefix else []) == list(seq[:-1]):
                logits[row, seq[-1]] = float("-inf")
    return logits


def test_device_bans_equal_vllms_loop() -> None:
    rng = random.Random(0)
    vocab, batch = 40, 9
    for _ in range(30):
        words = [[tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))
                  for _ in range(rng.randint(0, 4))] for _ in range(batch)]
        outputs = [[rng.randrange(4) for _ in range(rng.randint(0, 6))] for _ in range(batch)]
        for row in words:  # make some prefixes match the output's end
            for k, seq in enumerate(row):
                if k % 2 == 0 and len(seq) > 1:
                    row[k] = tuple(rng.randrange(4) for _ in seq[:-1]) + seq[-1:]
        rows = [SamplingRow(SamplingParams(), len(out), [1], out, bad_words_ids=tuple(w))
                for w, out in zip(words, outputs, strict=True)]
        logits = torch.randn(batch, vocab)
        got = apply_bad_words(logits, rows)
        assert torch.equal(got, _reference_bans(logits, words, outputs))


def test_allowed_token_ids(llm: LLM, plain: list[int]) -> None:
    allowed = sorted(set(plain[:6]))
    for params in (SamplingParams(temperature=0, max_tokens=20, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.0, seed=4, max_tokens=20,
                                  allowed_token_ids=allowed)):
        out = llm.generate(PROMPT, params)[0]
        assert out.token_ids and set(out.token_ids) <= set(allowed), out.token_ids
    vocab = llm.engine.runner.shape.vocab_size
    with pytest.raises(PromptError) as caught:
        llm.engine.add_request("oov", PROMPT, SamplingParams(allowed_token_ids=[1, vocab]))
    assert caught.value.param == "allowed_token_ids" and str(vocab) in str(caught.value)


def test_truncate_prompt_tokens(llm: LLM) -> None:
    tok, prompts = llm.tokenizer, llm.engine.prompts
    text = "The quick brown fox jumps over the lazy dog. " * 3
    full = tok(text).input_ids
    keep = SamplingParams(max_tokens=2, truncate_prompt_tokens=5)
    assert prompts.build(prompt=text, params=keep) == full[-5:]
    assert prompts.build(prompt_token_ids=full, params=keep) == full[-5:]
    # -1: the context's worth (vLLM's), which leaves no room to generate
    context = llm.engine.max_model_len
    long = list(range(10, 10 + context + 50))
    with pytest.raises(PromptError) as caught:
        prompts.build(prompt_token_ids=long, params=SamplingParams(
            truncate_prompt_tokens=-1, fit_to_context=True))
    assert caught.value.num_prompt_tokens == context and caught.value.exact


def test_stop_reason(llm: LLM, plain: list[int]) -> None:
    tok = llm.tokenizer
    text = tok.decode(plain)
    stop = text[5:9]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32,
                                              stop_token_ids=[plain[3]]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == plain[3]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.finish_reason == "length" and out.stop_reason is None


@pytest.fixture(scope="module")
def fim_builder() -> PromptBuilder:
    tok = build_tokenizer(fim=True)
    return PromptBuilder(tok, PromptLimits(vocab_size=len(tok), max_model_len=512,
                                           num_blocks=64, block_size=16))


def test_chat_template_switches_and_kwargs(fim_builder: PromptBuilder) -> None:
    tok = fim_builder._tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well"}]

    def render(**kw: Any) -> str:
        return str(tok.decode(fim_builder.build(messages=messages,
                                                options=PromptOptions(**kw))))

    assert render() == "<|user|>hi<|end|><|assistant|>Well<|end|><|assistant|>"
    assert render(chat_template_kwargs={"enable_thinking": False}).endswith(
        "<|assistant|><|end|>")
    assert render(add_generation_prompt=False) == "<|user|>hi<|end|><|assistant|>Well<|end|>"
    assert render(add_generation_prompt=False, continue_final_message=True) == \
        "<|user|>hi<|end|><|assistant|>Well"
    with pytest.raises(PromptError) as caught:
        render(add_generation_prompt=True, continue_final_message=True)
    assert caught.value.param == "messages"


def test_fill_in_the_middle(fim_builder: PromptBuilder) -> None:
    tok = fim_builder._tokenizer()
    ids = fim_builder.build(prompt="def add(a, b):\n", options=PromptOptions(
        suffix="\n    return c\n"))
    prefix, suffix, middle = (tok.convert_tokens_to_ids(t) for t in FIM_TOKENS)
    assert ids[0] == prefix and ids[-1] == middle and suffix in ids
    assert tok.decode(ids) == "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n    return c\n" \
        "<|fim_middle|>"


def test_suffix_without_fim_tokens_names_suffix(llm: LLM) -> None:
    with pytest.raises(PromptError) as caught:
        llm.engine.prompts.build(prompt="def f(", options=PromptOptions(suffix="  return 1"))
    assert caught.value.param == "suffix" and "fill-in-the-middle" in str(caught.value)

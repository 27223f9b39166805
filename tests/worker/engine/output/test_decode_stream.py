"""``StreamingDetokenizer`` (``tokenizers``' ``DecodeStream``, the output process's decode)
gives exactly the text of the two window decodes through the transformers tokenizer."""

import json
import random

import pytest

from tests.checkpoints import build_tokenizer
from tests.worker.engine.output.test_detokenizer import byte_tokens, stream
from worker.engine.output.detokenizer import StreamingDetokenizer
from worker.engine.output.rust_decode import RustDecoder, decode_spec


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def byte_fallback_tokenizer():
    """A Llama-like sentencepiece tokenizer: ``<0xXX>`` byte tokens (byte fallback),
    ``▁`` word starts and the Replace/ByteFallback/Fuse/Strip decoder."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁the", "▁a", "é", "ö", "日本", "語"] + [chr(c) for c in range(97, 123)]
    pieces += ["▁" + chr(c) for c in range(97, 123)] + [".", ",", "!", "'s", "▁'"]
    model = models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>",
                       byte_fallback=True)
    raw = Tokenizer(model)
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>", clean_up_tokenization_spaces=False)
    hf.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    return hf


def random_ids(rng, vocab, n, byte_range=None):
    """Random ids; with ``byte_range`` half of them byte tokens of multi-byte characters,
    so partial UTF-8 (held back until whole, or U+FFFD for good) is common."""
    out = []
    for _ in range(n):
        if byte_range is not None and rng.random() < 0.5:
            out.append(byte_range[0] + rng.randrange(0x80, 0x100))
        else:
            out.append(rng.randrange(vocab))
    return out


def check_identical(hf, cases, rng, byte_range=None):
    rust = RustDecoder(decode_spec(hf))
    assert rust.streams
    vocab = len(hf)
    for i in range(cases):
        ids = random_ids(rng, vocab, rng.randrange(1, 60), byte_range)
        prompt = random_ids(rng, vocab, rng.randrange(0, 9), byte_range)
        prior = random_ids(rng, vocab, rng.randrange(0, 4), byte_range) if i % 4 == 0 else None
        kw = {"skip_special_tokens": i % 2 == 0, "prior_output_ids": prior,
              "stop": [rust.decode(ids[3:5])[:3] or "e"] if i % 3 == 0 else None,
              "include_stop_str_in_output": i % 6 == 0}
        assert stream(rust, ids, prompt, **kw) == stream(hf, ids, prompt, **kw), (i, ids)


def test_byte_level_random_ids_identical(tok):
    check_identical(tok, 400, random.Random(1))


def test_byte_fallback_random_ids_identical():
    hf = byte_fallback_tokenizer()
    check_identical(hf, 400, random.Random(2), byte_range=(3,))


def test_default_model_tokenizer_identical():
    from transformers import AutoTokenizer

    from worker.models import default_model_path

    check_identical(AutoTokenizer.from_pretrained(str(default_model_path())), 300,
                    random.Random(3))


def test_split_characters_and_a_prompt_ending_mid_character(tok):
    """A character split over byte tokens is held back until whole; a prompt tail that
    ends inside a character (nothing whole to prime with) decodes the window way."""
    rust = RustDecoder(decode_spec(tok))
    full = byte_tokens(tok, "héllo wörld 😀 ok")
    for cut in range(len(full)):
        assert stream(rust, full[cut:], full[:cut]) == stream(tok, full[cut:], full[:cut])
    d = StreamingDetokenizer(rust, full[:2])  # 'h' + the first byte of 'é'
    assert d._stream is None
    d.step(full[2])  # completes 'é': nothing past the tail's text yet, still the windows
    assert d._stream is None
    assert d.step(full[3]).text_delta == "l" and d._stream is not None  # back at a chunk
    d = StreamingDetokenizer(rust, full[:3])
    assert d._stream is not None


def test_clean_up_and_unsafe_decoders_keep_the_window_decodes(tok):
    spec = decode_spec(tok)
    assert not RustDecoder({**spec, "clean_up": True}).streams
    data = json.loads(spec["json"])
    data["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": True}
    assert not RustDecoder({**spec, "json": json.dumps(data)}).streams

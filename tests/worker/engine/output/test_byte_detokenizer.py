"""``ByteDetokenizer`` (the output process's detokenizer for byte-level BPE) gives exactly
the deltas of ``StreamingDetokenizer`` (``DecodeStream``) and of the two window decodes
through the transformers tokenizer, token by token, and its UTF-8 rules are Rust's."""

import json
import random

import pytest

from tests.worker.engine.output.test_decode_stream import byte_fallback_tokenizer
from tests.worker.engine.output.test_detokenizer import byte_tokens
from worker.engine.output.byte_detokenizer import (
    ByteDetokenizer,
    ends_in_replacement,
    make_detokenizer,
)
from worker.engine.output.detokenizer import IncrementalDetokenizer, StreamingDetokenizer
from worker.engine.output.rust_decode import RustDecoder, byte_pieces, decode_spec

STUB_VOCAB = 512  # ops/bench/engine/host_stub.py: the stub model's ids


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    from worker.models import default_model_path

    return AutoTokenizer.from_pretrained(str(default_model_path()))


@pytest.fixture(scope="module")
def rust(hf):
    decoder = RustDecoder(decode_spec(hf))
    assert decoder.byte_pieces is not None
    return decoder


def pieces(cls, tok, ids, prompt=(), **kw):
    """Every step's (delta, stopped, stop string), then the flush unless stopped."""
    d = cls(tok, list(prompt), **kw)
    out = []
    for t in ids:
        r = d.step(t)
        out.append((r.text_delta, r.stopped, r.stop_str))
        if r.stopped:
            return out
    out.append(d.flush())
    return out


def assert_same(hf, rust, ids, prompt=(), **kw):
    fast = pieces(ByteDetokenizer, rust, ids, prompt, **kw)
    assert fast == pieces(StreamingDetokenizer, rust, ids, prompt, **kw)
    assert fast == pieces(IncrementalDetokenizer, hf, ids, prompt, **kw)
    return fast


def _single_byte_ids(rust):
    """byte -> the id of the token that is exactly that byte."""
    return {p[0]: i for i, p in enumerate(rust.byte_pieces[False].pieces) if len(p) == 1}


def test_python_lossy_utf8_is_rusts(rust):
    """``bytes.decode("utf-8", "replace")`` equals tokenizers' ``from_utf8_lossy`` on every
    two-byte string and on random longer ones (lead bytes, continuations, overlongs,
    surrogates, 0xF5-0xFF), and ``ends_in_replacement`` reads its last character right."""
    ids = _single_byte_ids(rust)
    assert len(ids) == 256
    rng = random.Random(7)
    cases = [bytes([a, b]) for a in range(0x70, 0x100) for b in range(0x70, 0xC4)]
    hot = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0,
           0xE1, 0xED, 0xEE, 0xEF, 0xBD, 0xF0, 0xF3, 0xF4, 0xF5, 0xFF]
    cases += [bytes(rng.choice(hot) if rng.random() < 0.7 else rng.randrange(256)
                    for _ in range(rng.randrange(1, 14))) for _ in range(20000)]
    texts = rust.rust.decode_batch([[ids[b] for b in c] for c in cases],
                                   skip_special_tokens=False)
    for case, text in zip(cases, texts, strict=True):
        assert case.decode("utf-8", "replace") == text, case
        assert ends_in_replacement(case) == text.endswith("\ufffd"), case


@pytest.mark.parametrize("skip", [True, False])
def test_stub_range_ids_token_by_token(hf, rust, skip):
    """The stub model's ids (0..511: raw bytes galore, ``<|endoftext|>`` at 0), with
    prompt tails, prior output (a resumed request) and stop strings."""
    rng = random.Random(11 + skip)
    for i in range(500):
        ids = [rng.randrange(STUB_VOCAB) for _ in range(rng.randrange(1, 90))]
        prompt = [rng.randrange(STUB_VOCAB) for _ in range(rng.randrange(0, 9))]
        prior = [rng.randrange(STUB_VOCAB) for _ in range(rng.randrange(1, 6))] \
            if i % 4 == 0 else None
        stop = [rust.decode(ids[2:5])[:2] or "e", "\ufffd"][: 1 + (i % 5 == 0)] \
            if i % 3 == 0 else None
        assert_same(hf, rust, ids, prompt, skip_special_tokens=skip, prior_output_ids=prior,
                    stop=stop, include_stop_str_in_output=i % 6 == 0)


def test_long_runs_of_bytes_that_never_make_a_character(hf, rust):
    """400 continuation bytes, then text: held back while they end in U+FFFD, then one
    delta with all the replacement characters (no decode of a growing buffer per token)."""
    ids = _single_byte_ids(rust)
    soup = [ids[0x80 + k % 64] for k in range(400)] + [ids[ord("a")], ids[0xE2]]
    got = assert_same(hf, rust, soup + [ids[0x82], ids[0xAC], ids[ord("b")]])
    assert [p[0] for p in got[:-1] if p[0]] == ["\ufffd" * 400 + "a", "€", "b"]


def test_real_text_round_trips(hf, rust):
    texts = ["héllo wörld, it's 😀 ok?", "日本語のテキスト\n\t x", "def f(x):\n    return x"]
    for text in texts:
        for ids in (hf.encode(text, add_special_tokens=False), byte_tokens(hf, text)):
            got = assert_same(hf, rust, ids, hf.encode("x = 1", add_special_tokens=False))
            assert "".join(p[0] for p in got[:-1]) + got[-1] == text


def test_prompt_ending_mid_character(hf, rust):
    """A prompt tail ending inside a character: its bytes (T) stay undecided, so output
    bytes that complete that character are the prompt's, not the output's."""
    full = byte_tokens(hf, "héllo wörld 😀 ok")
    for cut in range(len(full)):
        assert_same(hf, rust, full[cut:], full[:cut])
        assert_same(hf, rust, full[cut:], full[:cut], stop=["ö"])
    d = ByteDetokenizer(rust, full[:2])  # 'h' + the first byte of 'é'
    assert d._tail == "é".encode()[:1]
    assert d.step(full[2]).text_delta == ""  # completes 'é': not longer than the prompt's
    assert d.step(full[3]).text_delta == "l" and d._tail == b""


def test_make_detokenizer_picks_the_table_only_for_byte_level(hf, rust):
    assert isinstance(make_detokenizer(rust, [1, 2]), ByteDetokenizer)
    assert type(make_detokenizer(hf, [1, 2])) is IncrementalDetokenizer
    fallback = RustDecoder(decode_spec(byte_fallback_tokenizer()))  # sentencepiece-like
    assert fallback.streams and fallback.byte_pieces is None
    assert type(make_detokenizer(fallback, [1])) is StreamingDetokenizer
    clean = RustDecoder({**decode_spec(hf), "clean_up": True})
    assert clean.byte_pieces is None and type(make_detokenizer(clean, [1])) is \
        IncrementalDetokenizer


def test_a_table_that_disagrees_with_the_decoder_is_refused(rust):
    """The table is checked against the tokenizer's own decode: a JSON that claims
    ByteLevel over a tokenizer decoding otherwise gets no table (DecodeStream instead)."""
    from tokenizers import Tokenizer, decoders

    data = json.loads(rust.rust.to_str())
    assert byte_pieces(rust.rust, data) is not None
    other = Tokenizer.from_str(rust.rust.to_str())
    other.decoder = decoders.Metaspace()
    assert byte_pieces(other, data) is None

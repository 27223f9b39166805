import pytest

from tests.checkpoints import build_tokenizer
from worker.engine.output.detokenizer import IncrementalDetokenizer
from worker.engine.output.rust_decode import gpt2_byte_chars


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def stream(tok, ids, prompt=(), **kw):
    d = IncrementalDetokenizer(tok, list(prompt), **kw)
    pieces, stopped = [], False
    for t in ids:
        r = d.step(t)
        pieces.append(r.text_delta)
        if r.stopped:
            stopped = True
            break
    if not stopped:
        pieces.append(d.flush())
    return pieces, stopped


def byte_tokens(tok, text):
    """One token per UTF-8 byte, so multi-byte characters are split across tokens."""
    vocab = tok.get_vocab()
    byte_to_char = {b: c for c, b in gpt2_byte_chars().items()}  # byte -> printable char
    return [vocab[byte_to_char[b]] for b in text.encode("utf-8")]


@pytest.mark.parametrize("text", ["héllo wörld", "日本語", "🚀 go 🔥", "a€b"])
def test_multibyte_characters_split_across_tokens(tok, text):
    ids = byte_tokens(tok, text)
    pieces, _ = stream(tok, ids, prompt=tok("x = 1")["input_ids"])
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_regular_tokens_roundtrip(tok):
    text = "def fibonacci(n):\n    return a"
    pieces, _ = stream(tok, tok(text)["input_ids"])
    assert "".join(pieces) == text


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tok, include):
    text = "abc STOPPER xyz"
    ids = byte_tokens(tok, text)
    pieces, stopped = stream(tok, ids, stop=["STOP"], include_stop_str_in_output=include)
    assert stopped
    assert "".join(pieces) == ("abc STOP" if include else "abc ")
    # nothing that belongs to the stop string leaks out before the match
    assert all("S" not in p for p in pieces[:-1]) or include


def test_partial_stop_prefix_is_flushed_when_not_a_stop(tok):
    ids = byte_tokens(tok, "value END")
    pieces, stopped = stream(tok, ids, stop=["ENDING"])
    assert not stopped and "".join(pieces) == "value END"


def test_earliest_of_several_stop_strings(tok):
    ids = byte_tokens(tok, "one two three")
    pieces, stopped = stream(tok, ids, stop=["three", "two"])
    assert stopped and "".join(pieces) == "one "


def test_resume_with_prior_output_sends_only_new_text(tok):
    full = byte_tokens(tok, "héllo there")
    d = IncrementalDetokenizer(tok, [], prior_output_ids=full[:3])  # 'h' + both bytes of 'é'
    rest = "".join(d.step(t).text_delta for t in full[3:]) + d.flush()
    assert rest == "llo there"


@pytest.mark.parametrize("skip", [True, False])
def test_rust_backend_streams_the_same_text(tok, skip):
    """The output process decodes with the tokenizers library alone (no transformers, no
    torch): every stream's pieces must equal those through the transformers tokenizer."""
    import random

    from worker.engine.output.rust_decode import RustDecoder, decode_spec

    rust = RustDecoder(decode_spec(tok))
    rng = random.Random(0)
    vocab = len(tok)
    texts = ["héllo wörld, it's 😀 ok?", "a . b , c ! don't I'm", "日本語のテキスト\n\t x"]
    for i in range(60):
        if i < len(texts):
            ids = tok.encode(texts[i], add_special_tokens=False)
        else:
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        kw = {"skip_special_tokens": skip, "stop": ["e,"] if i % 3 == 0 else None}
        assert stream(rust, ids, prompt, **kw) == stream(tok, ids, prompt, **kw), i

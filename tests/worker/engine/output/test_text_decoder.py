"""One builder for the output side's decoder (``text_decoder``), in process and in the
output process: for each of the repository's tokenizers (the default model's and the test
ones) and a tokenizer with a Rust spec that cannot stream (WordPiece with transformers'
clean-up), the decoder built either way decodes every token alone and random sequences,
with and without special tokens, to the transformers tokenizer's text."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.checkpoints import build_tokenizer
from tests.worker.engine.output.test_decode_stream import byte_fallback_tokenizer
from worker.engine.output.rust_decode import RustDecoder, decode_spec, text_decoder
from worker.service.output_proc.process import load_tokenizer


def wordpiece_clean_up() -> Any:
    """A BERT-like tokenizer: WordPiece decoder and ``clean_up_tokenization_spaces``, so its
    ``RustDecoder`` has no ``DecodeStream`` (window decodes through ``decode``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "sat", ".", ",", "!", "?",
             "'", "s", "n", "t", "##s", "##t", "re", "ve", "m", "do", "##n", "don", "a", "é",
             "##é"]
    raw = Tokenizer(models.WordPiece({p: i for i, p in enumerate(vocab)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    raw.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)


def default_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from worker.models import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


TOKENIZERS = {"default_model": default_tokenizer, "test_bpe": build_tokenizer,
              "test_bpe_fim": lambda: build_tokenizer(fim=True),
              "byte_fallback": byte_fallback_tokenizer, "wordpiece_clean_up": wordpiece_clean_up}


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_one_builder_decodes_as_transformers(name: str) -> None:
    tok = TOKENIZERS[name]()
    spec = decode_spec(tok)
    assert spec is not None  # every repository tokenizer is a fast one
    in_process = text_decoder(spec, lambda: tok)
    remote = load_tokenizer({"decode_spec": spec, "tokenizer": "(not loaded)"})
    assert isinstance(in_process, RustDecoder) and isinstance(remote, RustDecoder)
    assert in_process.streams == remote.streams == (name != "wordpiece_clean_up")
    rng = random.Random(0)
    vocab = len(tok)
    singles = range(vocab) if vocab <= 4096 else rng.sample(range(vocab), 4096)
    cases = [[i] for i in singles]
    cases += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(400)]
    for skip in (False, True):
        want = [tok.decode(ids, skip_special_tokens=skip) for ids in cases]
        assert [in_process.decode(ids, skip_special_tokens=skip) for ids in cases] == want
        assert [remote.decode(ids, skip_special_tokens=skip) for ids in cases] == want


def test_no_spec_keeps_the_tokenizer() -> None:
    tok = object()
    assert text_decoder(None, lambda: tok) is tok

"""Corpus, split and tokenizer for Ferry's default model.

The corpus is the pure-Python standard library of the running interpreter: every machine
that can run Ferry has it, offline, so the default model can be rebuilt anywhere without a
download. Everything here is deterministic (sorted paths, index-based split) so that two
runs on the same interpreter see byte-identical data.
"""

from __future__ import annotations

import gzip
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS = "<|endoftext|>"

# Directories skipped anywhere in the tree: test suites (huge, repetitive and not what a
# user's code looks like), the IDE, the 2to3 fixer zoo, third-party code, and machine-
# generated tables (codec maps, the pydoc topic dump) that would only teach hex literals.
EXCLUDED_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "lib2to3",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "encodings",
        "pydoc_data",
        "turtledemo",
        "ensurepip",
    }
)
# Per-machine generated files: their content differs between builds of the same Python.
EXCLUDED_PREFIXES = ("_sysconfigdata",)

# Pre-tokenisation for code: a newline run takes the next line's indentation with it, and a
# word or punctuation run takes ONE following space. GPT-2's rule (a space starts the next
# word) would make a prompt ending in a space, such as ``"def "``, end in a lone-space token
# the model almost never saw; here ``"def "`` is the same piece as in ``"def main"``.
PRETOKENIZE = r"(?:\r?\n)+[ \t]*|\w+ ?|[^\s\w]+ ?|\s+"

HELDOUT_EVERY = 20  # every 20th file (by sorted relative path) is held out ...
HELDOUT_OFFSET = 7  # ... starting at index 7, so the split is not just the alphabet's head

# A plain-text chat layout: the model has only seen Python, so role markers are ordinary
# text and each turn ends with the one special token the model does know; the leading
# BOS is there because ``apply_chat_template`` does not add special tokens itself.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + '\\n' + message['content'] + '" + EOS + "\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Corpus:
    """The stdlib files, split into training and held-out text (one string per file)."""

    root: Path
    train_paths: list[str]
    heldout_paths: list[str]
    train_texts: list[str]
    heldout_texts: list[str]


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path) -> list[str]:
    """Sorted relative paths of the stdlib ``.py`` files that make up the corpus."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py") and not name.startswith(EXCLUDED_PREFIXES):
                found.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(found)


def is_heldout(index: int) -> bool:
    """Whether the file at ``index`` of the sorted list is reserved for evaluation."""
    return index % HELDOUT_EVERY == HELDOUT_OFFSET


def load_corpus(root: Path | None = None) -> Corpus:
    """Read and split the corpus; undecodable files are skipped rather than mangled."""
    root = root or stdlib_root()
    train_paths: list[str] = []
    heldout_paths: list[str] = []
    train_texts: list[str] = []
    heldout_texts: list[str] = []
    for index, rel in enumerate(list_sources(root)):
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if not text.strip():
            continue
        if is_heldout(index):
            heldout_paths.append(rel)
            heldout_texts.append(text)
        else:
            train_paths.append(rel)
            train_texts.append(text)
    return Corpus(root, train_paths, heldout_paths, train_texts, heldout_texts)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE over the training texts only, with ``EOS`` as special token 0.

    Byte-level means every string round-trips (no unknown token), which the bits-per-byte
    figure relies on: the held-out bytes are exactly what the model is scored on.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode_stream(tok: Tokenizer, texts: list[str]) -> list[int]:
    """``EOS doc EOS doc ... EOS``: every document starts right after an EOS token."""
    eos = tok.token_to_id(EOS)
    stream = [eos]
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        stream.extend(enc.ids)
        stream.append(eos)
    return stream


def gzip_bits_per_byte(texts: list[str]) -> tuple[float, float]:
    """``gzip -9`` bits per byte, (per file summed, concatenation) over UTF-8 bytes.

    Python's ``gzip`` at level 9 is the same zlib deflate as the ``gzip -9`` binary; the
    per-file figure includes one 20-byte-ish gzip header per file, as ``gzip -9`` would.
    """
    blobs = [t.encode("utf-8") for t in texts]
    raw = sum(len(b) for b in blobs)
    per_file = sum(len(gzip.compress(b, compresslevel=9, mtime=0)) for b in blobs)
    joined = len(gzip.compress(b"".join(blobs), compresslevel=9, mtime=0))
    return 8.0 * per_file / raw, 8.0 * joined / raw

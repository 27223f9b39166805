"""The default model that ships in the package: present, intact, loadable offline, usable.

These guard the promise that Ferry runs with no network: the weights must load from the
package directory alone, match the checksum the model card publishes (so a stray re-save or
a truncated LFS pointer is caught), stay within the size budget, and generate text.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pytest
import torch

from worker.models import DEFAULT_MODEL_DIR, default_model_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DOC = Path(__file__).resolve().parents[2] / "docs" / "model.md"
MAX_BYTES = 30 * 1024 * 1024
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()


def test_files_present_and_small() -> None:
    assert DEFAULT_MODEL_DIR.is_dir()
    for name in REQUIRED:
        assert (DEFAULT_MODEL_DIR / name).is_file(), name
    size = sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.rglob("*") if f.is_file())
    assert size <= MAX_BYTES, f"default model folder is {size} bytes"


def test_checksum_matches_model_card() -> None:
    card = DOC.read_text()
    match = re.search(r"model\.safetensors`? sha256:\s*`?([0-9a-f]{64})", card)
    assert match, "docs/model.md must state the sha256 of model.safetensors"
    digest = hashlib.sha256((DEFAULT_MODEL_DIR / "model.safetensors").read_bytes()).hexdigest()
    assert digest == match.group(1)


def test_loads_offline_as_llama(model, tokenizer) -> None:
    assert model.config.model_type == "llama"
    assert tokenizer.eos_token == "<|endoftext|>"
    eos = tokenizer.eos_token_id
    assert eos == model.config.eos_token_id == model.generation_config.eos_token_id
    text = "def add(a, b):\n    return a + b\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text  # byte-level BPE round-trips
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "hi" in rendered and rendered.endswith("### assistant\n")


def test_greedy_generate_def(model, tokenizer) -> None:
    enc = tokenizer("def ", return_tensors="pt")
    out = model.generate(**enc, do_sample=False, max_new_tokens=16)
    new = out[0, enc.input_ids.shape[1]:]
    assert len(new) > 0
    assert tokenizer.decode(new, skip_special_tokens=True).strip()


def test_ferry_engine_greedy_matches_transformers(model, tokenizer) -> None:
    """Ferry's own engine must produce transformers' greedy tokens on the shipped model."""
    from worker import LLM, SamplingParams

    n = 24
    for prompt in ("def ", "class ", "import "):
        prompt_ids = tokenizer(prompt).input_ids
        ids = torch.tensor([prompt_ids])
        model.generation_config.eos_token_id = None  # like ignore_eos, without masking EOS
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=n)[0, len(prompt_ids):].tolist()
        llm = LLM(model=default_model_path(), dtype="float32", device="cpu", kv_cache_blocks=8,
                  max_num_seqs=1)
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        assert llm.generate([prompt_ids], params)[0].token_ids == expected, prompt

"""Models that ship inside the worker package (its package data).

``default/`` is a small Llama trained on the Python standard library (see ``docs/model.md``
and ``ops/train/``). It lives in the package so that Ferry runs its main job, and its
tests, with no network and no GPU: callers pass :func:`default_model_path` wherever a
Hugging Face model id or directory is expected.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR: Path = Path(__file__).resolve().parent / "default"


def default_model_path() -> str:
    """The default model's directory as a string, for ``from_pretrained``-style APIs."""
    return str(DEFAULT_MODEL_DIR)


__all__ = ["DEFAULT_MODEL_DIR", "default_model_path"]

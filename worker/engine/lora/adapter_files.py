"""An adapter's two files read with bounds: the config by size and depth, the weights' header first.

Why: an adapter's path names files a tenant chose. ``adapter_config.json`` nested
100,000 deep would exhaust the JSON parser's recursion (a ``RecursionError``, not a
refusal), a huge one would be read whole, and a path at a large safetensors file that
is no adapter (a base model's own weights) would be loaded into memory before its keys
were looked at. So the config is read up to ``MAX_CONFIG_BYTES`` and its nesting
measured before it is parsed, and the weights' header (names, dtypes, shapes) goes to
the caller's checks before any tensor is read.

Every refusal is a ``LoraError`` that never quotes a server path: a missing, unreadable
or irregular file (a directory, a FIFO) is ``MISSING`` whatever the cause, so the
message tells nothing about the server's filesystem. ``LoraError`` lives here, at the
bottom of the imports, and ``adapter.py`` re-exports it.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # PEFT writes a few hundred bytes
MAX_CONFIG_DEPTH = 32  # PEFT's configs nest 2 or 3 levels
MISSING = "adapter files are missing or unreadable"

# a tensor's (safetensors dtype name, shape), from the file's header
Header = dict[str, tuple[str, list[int]]]


class LoraError(ValueError):
    """An adapter that cannot be served on this base model; the message says why."""


def refuse(name: str, problem: str) -> LoraError:
    return LoraError(f"LoRA adapter {name!r}: {problem}")


def check_dir(name: str, root: Path) -> None:
    try:
        ok = stat.S_ISDIR(os.stat(root).st_mode)
    except (OSError, ValueError):  # ValueError: a NUL in the path
        ok = False
    if not ok:
        raise refuse(name, MISSING)


def read_config(name: str, root: Path) -> dict[str, Any]:
    """``adapter_config.json`` as a dict: at most ``MAX_CONFIG_BYTES``, nested at most
    ``MAX_CONFIG_DEPTH`` deep, strict JSON (no ``NaN`` or ``Infinity``)."""
    try:
        with open(root / CONFIG_FILE, "rb", opener=_nonblocking) as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise refuse(name, MISSING)
            data = fh.read(MAX_CONFIG_BYTES + 1)
    except (OSError, ValueError) as exc:
        if isinstance(exc, LoraError):
            raise
        raise refuse(name, MISSING) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise refuse(name, f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES >> 20} MiB")
    if json_depth(data) > MAX_CONFIG_DEPTH:
        raise refuse(name, f"{CONFIG_FILE} nests deeper than {MAX_CONFIG_DEPTH} levels")
    try:
        cfg = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise refuse(name, f"{CONFIG_FILE} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise refuse(name, f"{CONFIG_FILE} is not valid JSON ({exc.msg} at line "
                           f"{exc.lineno} column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:  # NaN/Infinity; an int of 5,000 digits
        raise refuse(name, f"{CONFIG_FILE} is not valid JSON ({str(exc)[:80]})") from None
    if not isinstance(cfg, dict):
        raise refuse(name, f"{CONFIG_FILE} is not a JSON object")
    return cfg


def read_weights(name: str, root: Path, check: Callable[[Header], None]
                 ) -> dict[str, torch.Tensor]:
    """The tensors of ``adapter_model.safetensors``; ``check`` sees the header first and
    raises ``LoraError`` to refuse the file before any tensor is read."""
    from safetensors import SafetensorError, safe_open

    file = root / WEIGHTS_FILE
    try:
        regular = stat.S_ISREG(os.stat(file).st_mode)
    except (OSError, ValueError):
        regular = False
    if not regular:
        raise refuse(name, MISSING)
    try:
        with safe_open(str(file), framework="pt") as f:
            header: Header = {}
            keys = f.keys()
            for key in keys:
                piece = f.get_slice(key)
                header[key] = (piece.get_dtype(), list(piece.get_shape()))
            check(header)
            return {key: f.get_tensor(key) for key in header}
    except LoraError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError):
        raise refuse(name, f"{WEIGHTS_FILE} is corrupt or unreadable") from None


def json_depth(data: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings do not
    count), in a few array passes: no recursion, linear in the size. Exact for any
    valid prefix, which is all a parser reads before it fails."""
    b = np.frombuffer(data, dtype=np.uint8)
    if not b.size:
        return 0
    idx = np.arange(b.size, dtype=np.int64)
    plain = np.maximum.accumulate(np.where(b != 0x5C, idx, -1))  # last non-backslash <= i
    escapes = np.zeros_like(idx)  # backslashes right before i
    escapes[1:] = idx[:-1] - plain[:-1]
    quotes = (b == 0x22) & (escapes % 2 == 0)  # the quotes that open or close a string
    outside = np.cumsum(quotes, dtype=np.int64) % 2 == 0
    opens = outside & ((b == 0x5B) | (b == 0x7B))
    closes = outside & ((b == 0x5D) | (b == 0x7D))
    return int(np.cumsum(opens.astype(np.int32) - closes.astype(np.int32)).max(initial=0))


def _nonblocking(path: str, flags: int) -> int:
    """Opening a FIFO for reading would wait for a writer; with O_NONBLOCK it returns and
    ``fstat`` refuses it."""
    return os.open(path, flags | os.O_NONBLOCK)


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a JSON number")

"""Where LoRA adapters may be read from: the configured roots, and the one refusal.

A runtime load names a directory (``lora_path``) that a worker opens. Only directories at or
under an operator's roots may be opened: ``FERRY_LORA_ROOTS`` (comma-separated), else
``FERRY_LORA_DIR`` alone, else none, and then loading by path at run time is refused (the
adapters a worker is started with, ``--lora NAME=PATH``, are the operator's own and are not
confined). The worker that opens the files decides (``confine``): the path is resolved
first (``realpath``, every symlink followed), then it must lie inside a resolved root and
be a directory. A gateway with roots configured may refuse early on the path's text alone
(``lexically_allowed``); the worker's check is the one that counts.

Every refusal is the same sentence (``NOT_ALLOWED``), whatever the reason: a missing path,
a file, a directory outside the roots, ``/proc/1/root``, a symlink that leads out of a
root, a name no process may read. Telling them apart would let a caller map the worker's
filesystem.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

NOT_ALLOWED = "lora_path: not an allowed adapter path"
"""The whole message of every refusal of a path (no reason, no path)."""

MAX_PATH_CHARS = 1024
"""The longest ``lora_path`` a caller may give."""


class AdapterPathError(ValueError):
    """A path outside the roots, or not a directory; the message is ``NOT_ALLOWED``."""

    def __init__(self) -> None:
        super().__init__(NOT_ALLOWED)


def parse_roots(raw: str | None) -> tuple[str, ...]:
    """``FERRY_LORA_ROOTS``' directories (comma-separated; blanks ignored)."""
    return tuple(p.strip() for p in (raw or "").split(",") if p.strip())


def adapter_roots(roots: Iterable[str], lora_dir: str | None) -> tuple[str, ...]:
    """The roots in force: ``roots`` when any are given, else ``lora_dir`` alone, else none."""
    given = tuple(r for r in roots if r)
    if given:
        return given
    return (lora_dir,) if lora_dir else ()


def _inside(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # one relative, one absolute
        return False


def confine(path: str, roots: Sequence[str]) -> str:
    """The real path of ``path`` when it is a directory at or under one of ``roots`` (both
    resolved, symlinks followed); ``AdapterPathError`` for anything else."""
    if not roots or not path or len(path) > MAX_PATH_CHARS:
        raise AdapterPathError()
    try:
        real = os.path.realpath(path)
        allowed = any(_inside(real, os.path.realpath(root)) for root in roots)
        if allowed and os.path.isdir(real):
            return real
    except (OSError, ValueError):  # e.g. an embedded NUL, a name too long for the OS
        pass
    raise AdapterPathError()


def lexically_allowed(path: str, roots: Sequence[str]) -> bool:
    """Whether ``path``'s text names a place inside ``roots`` (``..`` folded, nothing read
    from the disk): the gateway's early refusal. A symlink can still lead out; the worker
    resolves it (``confine``)."""
    if not roots or not path or len(path) > MAX_PATH_CHARS or "\x00" in path:
        return False
    if not os.path.isabs(path):
        return False
    norm = os.path.normpath(path)
    return any(_inside(norm, os.path.normpath(root)) for root in roots if os.path.isabs(root))


def scrub(message: str, *paths: str | None) -> str:
    """``message`` with every given path replaced by ``<adapter>``: an error from reading an
    adapter's files must not show where they are."""
    for path in sorted({p for p in paths if p}, key=len, reverse=True):
        message = message.replace(path, "<adapter>")
    return message

"""Build a C++ kernel source into a shared library on first use, and cache it.

CPU kernels are plain C ABI functions (no torch headers), so a build takes about a
second with the system compiler and the library is loaded with ``ctypes``. The library
is cached under ``FERRY_KERNEL_CACHE`` (default ``~/.cache/ferry/kernels``) by a hash of
the source, the flags, the compiler's version and this CPU's feature flags, since it is
built with ``-march=native``: a cache copied to another machine rebuilds instead of
executing instructions that machine lacks. Several workers starting at once on one host
may build concurrently; each writes a private temporary file and renames it into place,
so none ever loads a half-written library.

Linking ``-fopenmp`` makes the library use the ``libgomp.so.1`` already loaded by
torch (same soname), so ``torch.set_num_threads`` sets its thread count too.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC")
# Linked separately and without -ffast-math: at link time that flag adds crtfastmath.o
# (GCC < 13 even for shared libraries), whose constructor turns on flush-to-zero for the
# whole process as soon as the library loads.
LINK_FLAGS = ("-shared", "-fopenmp")


class NativeBuildError(RuntimeError):
    """The kernel could not be built or loaded here (no compiler, or it failed)."""


def cache_dir() -> Path:
    override = os.environ.get("FERRY_KERNEL_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ferry" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str:
    name = os.environ.get("CXX", "g++")
    path = shutil.which(name)
    if path is None:
        raise NativeBuildError(f"no C++ compiler: {name!r} is not on PATH (set CXX)")
    return path


def build(source_name: str) -> Path:
    """Path of the built library for ``csrc/<source_name>``, building it if needed."""
    source = CSRC / source_name
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256("\0".join(
        [source.read_text(), " ".join(FLAGS + LINK_FLAGS), version, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp + ".o"
    try:
        for cmd in ([compiler, *FLAGS, "-c", "-o", obj, str(source)],
                    [compiler, *LINK_FLAGS, "-o", tmp, obj]):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise NativeBuildError(f"building {source.name} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


def load(source_name: str) -> ctypes.CDLL:
    """Build (or reuse) and load ``csrc/<source_name>``; ``NativeBuildError`` if impossible.

    ``ctypes.CDLL`` releases the GIL during calls, so the worker's I/O threads keep
    running while a kernel does.
    """
    try:
        path = build(source_name)
    except OSError as exc:  # a source left out of an install, a read-only cache dir, ...
        raise NativeBuildError(f"building {source_name} failed: {exc}") from exc
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeBuildError(f"loading {path} failed: {exc}") from exc

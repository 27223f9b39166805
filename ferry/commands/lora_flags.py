"""``ferry up``'s LoRA flags, handed on as the ``ferry worker`` flags of each worker it
starts (``--lora``, ``--enable-lora``, ``--max-loras``, ``--max-lora-rank``,
``--lora-roots``) and, for the roots, as its gateway's ``FERRY_LORA_ROOTS``.
"""

from __future__ import annotations

from typing import Annotated

import typer

# ``ferry up``'s options
LoraModules = Annotated[list[str] | None, typer.Option(
    "--lora", help="NAME=PATH: a LoRA adapter every worker serves as model NAME "
    "(repeatable; enables LoRA; FERRY_LORA_MODULES).")]
EnableLora = Annotated[bool, typer.Option(
    help="LoRA on without adapters at start, for /v1/load_lora_adapter.")]
LoraRoots = Annotated[list[str] | None, typer.Option(
    "--lora-root", help="A directory adapters loaded at run time may come from (repeatable; "
    "FERRY_LORA_ROOTS; default: FERRY_LORA_DIR alone, else none).")]
MaxLoras = Annotated[int | None, typer.Option(
    min=1, help="Adapters on the device at once (FERRY_MAX_LORAS).")]
MaxLoraRank = Annotated[int | None, typer.Option(
    min=1, help="Largest adapter rank accepted (FERRY_MAX_LORA_RANK).")]


def lora_args(modules: list[str] | None, enable: bool, max_loras: int | None,
              max_rank: int | None, roots: list[str] | None = None) -> list[str]:
    """The ``ferry worker`` flags for the LoRA flags given (none given: none, so each
    worker's own ``FERRY_*`` variables stay in force)."""
    bad = [m for m in modules or () if not all(p.strip() for p in m.partition("=")[::2])]
    if bad:
        raise typer.BadParameter(f"NAME=PATH, got {bad[0]!r}", param_hint="--lora")
    args = [arg for module in modules or () for arg in ("--lora", module)]
    if enable or modules:
        args.append("--enable-lora")
    if max_loras:
        args += ["--max-loras", str(max_loras)]
    if max_rank:
        args += ["--max-lora-rank", str(max_rank)]
    if roots:
        args += ["--lora-roots", ",".join(roots)]
    return args


def gateway_lora_env(roots: list[str] | None) -> dict[str, str]:
    """The gateway's part: the adapter roots it checks paths against (it reads
    ``FERRY_LORA_ROOTS``; given to its process alone, not written to this one's)."""
    return {"FERRY_LORA_ROOTS": ",".join(roots)} if roots else {}

"""``ferry up``'s LoRA flags as the variables its workers read at start
(``FERRY_LORA_MODULES``, ``FERRY_ENABLE_LORA``, ``FERRY_MAX_LORAS``, ``FERRY_MAX_LORA_RANK``,
and ``FERRY_LORA_ROOTS``, which its gateway reads too).
"""

from __future__ import annotations

from typing import Annotated

import typer

# ``ferry up``'s options (the variables below are what its workers read)
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


def lora_env(modules: list[str] | None, enable: bool, max_loras: int | None,
             max_rank: int | None, roots: list[str] | None = None) -> dict[str, str]:
    """The workers' LoRA variables for the flags given (each worker reads them at start)."""
    bad = [m for m in modules or () if not all(p.strip() for p in m.partition("=")[::2])]
    if bad:
        raise typer.BadParameter(f"NAME=PATH, got {bad[0]!r}", param_hint="--lora")
    env = {"FERRY_LORA_MODULES": ",".join(modules or ()), "FERRY_MAX_LORAS": max_loras,
           "FERRY_MAX_LORA_RANK": max_rank, "FERRY_ENABLE_LORA": int(enable or bool(modules)),
           "FERRY_LORA_ROOTS": ",".join(roots or ())}
    return {name: str(value) for name, value in env.items() if value}

"""``ferry up``'s LoRA flags as the variables its workers read at start
(``FERRY_LORA_MODULES``, ``FERRY_ENABLE_LORA``, ``FERRY_MAX_LORAS``, ``FERRY_MAX_LORA_RANK``).
"""

from __future__ import annotations

import typer


def lora_env(modules: list[str] | None, enable: bool, max_loras: int | None,
             max_rank: int | None) -> dict[str, str]:
    """The workers' LoRA variables for the flags given (each worker reads them at start)."""
    bad = [m for m in modules or () if not all(p.strip() for p in m.partition("=")[::2])]
    if bad:
        raise typer.BadParameter(f"NAME=PATH, got {bad[0]!r}", param_hint="--lora")
    env = {"FERRY_LORA_MODULES": ",".join(modules or ()), "FERRY_MAX_LORAS": max_loras,
           "FERRY_MAX_LORA_RANK": max_rank, "FERRY_ENABLE_LORA": int(enable or bool(modules))}
    return {name: str(value) for name, value in env.items() if value}

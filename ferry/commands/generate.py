"""``ferry generate``: one prompt through the in-process engine, streamed to stdout.

Only typer is imported at module level; torch and the engine load when the command runs.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from worker import Engine
    from worker.engine.output.text_output import TextOutputs


def generate(
    args: Annotated[list[str], typer.Argument(help="[MODEL] PROMPT")],
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 means greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Keep the k likeliest tokens (0: off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus probability mass.")] = 1.0,
    min_p: Annotated[float, typer.Option(help="Drop tokens below min_p * p_max.")] = 0.0,
    repetition_penalty: Annotated[float, typer.Option()] = 1.0,
    presence_penalty: Annotated[float, typer.Option()] = 0.0,
    frequency_penalty: Annotated[float, typer.Option()] = 0.0,
    seed: Annotated[int | None, typer.Option(help="Per-request sampling seed.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Keep going past EOS.")] = False,
    chat: Annotated[bool, typer.Option(help="Send PROMPT as a chat user message.")] = False,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16")] = "auto",
    attention_backend: Annotated[str, typer.Option(help="auto, cpu, torch, triton")] = "auto",
    stats: Annotated[bool, typer.Option(help="Print token counts and speed.")] = True,
) -> None:
    if len(args) not in (1, 2):
        raise typer.BadParameter("expected [MODEL] PROMPT", param_hint="args")
    model, prompt = (None, args[0]) if len(args) == 1 else (args[0], args[1])

    from pydantic import ValidationError

    from protocol.sampling import SamplingParams
    from worker import Engine, EngineConfig
    from worker.engine.output.text_output import TextOutputs

    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p, repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            seed=seed, stop=stop or [], ignore_eos=ignore_eos,
        )
    except ValidationError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if model is None:
        from worker.models import default_model_path

        model = default_model_path()
    try:
        engine = Engine(EngineConfig.create(
            model, device=device, dtype=dtype, attention_backend=attention_backend,
            memory_bytes=256 << 20,
        ))
        if chat:
            engine.add_request("cli", None, params, messages=[{"role": "user", "content": prompt}])
        else:
            engine.add_request("cli", prompt, params)
    except ValueError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from exc
    n, reason, elapsed = _stream(engine, TextOutputs(engine), None if chat else prompt)
    if stats:
        typer.secho(
            f"[{n} tokens in {elapsed:.2f}s, {n / max(elapsed, 1e-9):.1f} tok/s, "
            f"finish_reason={reason}]", fg="cyan", err=True,
        )


def _stream(engine: Engine, text: TextOutputs, echo: str | None
            ) -> tuple[int, str | None, float]:
    """Step the engine to the end, writing ``echo`` (a plain prompt) and then the text as it
    comes; returns the tokens generated, the finish reason and the seconds taken."""
    if echo is not None:
        sys.stdout.write(echo)
    start = time.perf_counter()
    n, reason = 0, None
    while engine.has_unfinished_requests():
        for out in text.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
            n += len(out.new_token_ids)
            reason = out.finish_reason if out.finished else reason
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    return n, reason, elapsed

"""The ``ferry`` command line. Each subcommand imports its implementation lazily, so
``ferry gateway`` never loads torch: the modules registered here import only typer (and
``top`` only rich and the protocol) at module level."""

from __future__ import annotations

import typer

from ferry.commands import batcher as batcher_cmd
from ferry.commands import gateway as gateway_cmd
from ferry.commands import generate as generate_cmd
from ferry.commands import top as top_cmd
from ferry.commands import up as up_cmd
from ferry.commands import worker as worker_cmd

app = typer.Typer(
    help="Ferry: an LLM serving worker behind a Redis Streams queue.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Ferry: an LLM serving worker behind a Redis Streams queue."""


app.command(
    "generate",
    help="Generate from a prompt in-process and stream the text to the terminal.\n\n"
    "Usage: ferry generate [MODEL] PROMPT (MODEL defaults to the embedded model).",
)(generate_cmd.generate)
app.command("worker")(worker_cmd.worker)
app.command("gateway")(gateway_cmd.gateway)
app.command("batcher")(batcher_cmd.batcher)
app.command("up")(up_cmd.up)
app.command("top")(top_cmd.top)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

"""The ``ferry`` command line. Each subcommand imports its implementation lazily, so
``ferry gateway`` never loads torch."""

from __future__ import annotations

import typer

from ferry.commands import generate as generate_cmd

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


def main() -> None:
    app()


if __name__ == "__main__":
    main()

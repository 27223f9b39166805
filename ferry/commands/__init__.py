"""One module per ``ferry`` subcommand, each importing its heavy dependencies lazily."""

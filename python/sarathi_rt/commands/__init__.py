"""Subcommands of the `sarathi-rt` command line, one module each."""

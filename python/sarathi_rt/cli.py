"""The `sarathi-rt` command line (also `python -m sarathi_rt`). Each subcommand lives in
its own module under sarathi_rt.commands and registers itself here."""
from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, each with add_parser(subparsers) -> None and run(args) -> int.
COMMANDS = ["demo", "generate", "bench", "capacity", "profile", "deploy", "serve"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sarathi-rt", description="Sarathi-Serve style LLM inference runtime")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"sarathi_rt.commands.{name}").add_parser(subparsers)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

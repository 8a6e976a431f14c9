"""How a config field is declared once: its default, the text of its help and how its
command-line flag parses a value. The config dataclasses declare their fields with
`option(...)`; `sarathi_rt.config.flags` builds every command's flags from them and
`sarathi_rt.config.reference` the configuration page of the docs. Torch-free."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

# A field's metadata keys.
HELP, PARSE, CHOICES, METAVAR, FLAG = "help", "parse", "choices", "metavar", "flag"


def option(default: Any, help: str, *, parse: Callable[[str], Any] | None = None,
           choices: Sequence[str] | None = None, metavar: str | None = None, flag: bool = True) -> Any:
    """A dataclass field with its help text. `parse` turns the flag's text into the value
    (default: the type of `default`; a bool is a --x/--no-x switch); `flag=False` keeps
    a field off the command line (one the code that builds the config sets)."""
    return dataclasses.field(default=default, metadata={HELP: help, PARSE: parse, CHOICES: choices,
                                                        METAVAR: metavar, FLAG: flag})


def int_or_auto(text: str) -> int | str:
    """A flag that takes an int or the word "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"must be an int or 'auto', got {text!r}") from None


def read_json_file(what: str, path: str) -> Any:
    """A JSON file a setting names (`what`: the field or flag, as the error says it)."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"{what} {path!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path!r} is not valid JSON: {exc}") from None

"""Every command's engine flags, built from the config tree's fields by one function, so
each command that runs an engine has the same flags with the same spelling, meaning,
default and grouping. A flag is None until given: the default is the field's, applied
where the config is built, and a flag the chosen backend does not read can be named
as an error instead of being dropped."""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from sarathi_rt.utils.options import CHOICES, FLAG, HELP, METAVAR, PARSE, read_json_file

from .tree import SECTIONS, EngineConfig, field_names


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _default_text(f: dataclasses.Field) -> str:
    if f.default is None or f.default is dataclasses.MISSING or "default" in f.metadata[HELP]:
        return ""
    return f" (default {f.default})"


def _parser(f: dataclasses.Field) -> Any:
    """How the flag parses its text: the field's own parse, else the type of its default,
    else the first type its annotation names (`int | None` parses as int)."""
    if f.metadata[PARSE] is not None:
        return str  # parsed by given_options, whose errors name the field
    if f.default is not None:
        return type(f.default)
    first = str(f.type).split("|")[0].strip()
    return {"int": int, "float": float}.get(first, str)


def add_config_flags(parser: argparse.ArgumentParser, sections: Iterable[type] = SECTIONS) -> None:
    """One argument group per section, one flag per field, and --config FILE.json."""
    parser.add_argument("--config", metavar="FILE.json", default=None,
                        help="config fields as a JSON object (field names as in docs/configuration.md); "
                             "flags override it")
    for section in sections:
        group = parser.add_argument_group(f"{section.SECTION} ({section.__doc__.splitlines()[0].rstrip('.')})")
        for f in dataclasses.fields(section):
            if not f.metadata.get(FLAG, True):
                continue
            kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": f.metadata[HELP] + _default_text(f)}
            if isinstance(f.default, bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = _parser(f)
                if f.metadata[CHOICES]:
                    kwargs["choices"] = f.metadata[CHOICES]
                if f.metadata[METAVAR]:
                    kwargs["metavar"] = f.metadata[METAVAR]
            group.add_argument(flag_name(f.name), **kwargs)


def load_config_file(path: str) -> dict[str, Any]:
    """A JSON object of config fields; an unknown name is an error naming it."""
    data = read_json_file("--config", path)
    if not isinstance(data, Mapping):
        raise ValueError(f"--config {path!r} must hold a JSON object of config fields")
    unknown = sorted(set(data) - field_names(*SECTIONS))
    if unknown:
        raise ValueError(f"--config {path!r}: unknown config fields {unknown}")
    return dict(data)


def given_options(args: argparse.Namespace, sections: Iterable[type] = SECTIONS) -> dict[str, Any]:
    """The config fields the command line (and its --config file) set, by field name;
    the flags win over the file."""
    names = field_names(*sections)
    options = load_config_file(args.config) if getattr(args, "config", None) else {}
    unread = sorted(set(options) - names)
    if unread:
        raise ValueError(f"--config {args.config!r} sets {unread}, which this command does not use")
    for section in sections:
        for f in dataclasses.fields(section):
            value = getattr(args, f.name, None)
            if value is None:
                continue
            if f.metadata[PARSE] is not None and isinstance(value, str):
                try:
                    value = f.metadata[PARSE](value)
                except ValueError as exc:
                    message = str(exc)
                    raise ValueError(message if message.startswith(f.name) else f"{f.name} {message}") from None
            options[f.name] = value
    return options


def given_flags(options: Mapping[str, Any], names: Iterable[str]) -> list[str]:
    """The flags among `names` that `options` sets, spelled as on the command line."""
    return [flag_name(n) for n in names if n in options]


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig the flags (and --config) describe, every other field at its default."""
    return EngineConfig(**given_options(args) | overrides)

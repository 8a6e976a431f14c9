"""Policies by name, so configs, CLIs and simulators can pick one with a string.

A leaf module: the policies register into it when the package imports them, and the
config looks names up in it, so neither imports the other (the package's `__init__`
imports every built-in policy before anything can build a config)."""
from __future__ import annotations

from typing import Any, Protocol, TypeVar


class Policy(Protocol):
    """What the registry and the config read of a policy class (a Scheduler subclass,
    named here by its shape so that this module imports nothing of the scheduler)."""

    name: str
    chunked: bool  # prefills in chunks (takes chunk_size)
    adaptive: bool  # sizes steps in seconds (takes tbt_slo and the deadline policy)

    def check_config(self, config: Any) -> None: ...


_POLICIES: dict[str, Any] = {}
P = TypeVar("P")


def register_policy(cls: P) -> P:
    """Class decorator: make a Scheduler subclass available under `cls.name`."""
    name = getattr(cls, "name", "")
    if not name or name in _POLICIES:
        raise ValueError(f"policy name {name!r} is empty or already registered")
    _POLICIES[name] = cls
    return cls


def available_policies() -> list[str]:
    return sorted(_POLICIES)


def get_policy(name: str) -> Policy:
    try:
        return _POLICIES[name]
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(_POLICIES)}, got {name!r}") from None

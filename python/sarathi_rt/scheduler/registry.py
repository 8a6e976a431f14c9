"""Policies by name, so configs, CLIs and simulators can pick one with a string.

A leaf module: the policies register into it when the package imports them, and the
config looks names up in it, so neither imports the other (the package's `__init__`
imports every built-in policy before anything can build a config)."""
from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from .base import Scheduler
    from .config import SchedulerConfig
    from sarathi_rt.step_time import StepTimeModel

_POLICIES: dict[str, type[Scheduler]] = {}
S = TypeVar("S", bound="type[Scheduler]")


def register_policy(cls: S) -> S:
    """Class decorator: make a Scheduler subclass available under `cls.name`."""
    if not cls.name or cls.name in _POLICIES:
        raise ValueError(f"policy name {cls.name!r} is empty or already registered")
    _POLICIES[cls.name] = cls
    return cls


def available_policies() -> list[str]:
    return sorted(_POLICIES)


def get_policy(name: str) -> type[Scheduler]:
    try:
        return _POLICIES[name]
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(_POLICIES)}, got {name!r}") from None


def create_scheduler(config: SchedulerConfig, step_time_model: StepTimeModel | None = None) -> Scheduler:
    """The policy's scheduler; `step_time_model` sizes each step when config.tbt_slo is set."""
    return get_policy(config.policy)(config, step_time_model)


"""Quality-of-service classes: the deadlines a request's tokens are due by, and the
check that a finished request met them. Torch-free, like the rest of the scheduler."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sarathi_rt.utils.frozen import FrozenMap

QOS_POLICIES = ("deadline", "fcfs")


@dataclass(frozen=True)
class QoSClass:
    """A class of traffic. Its first token is due `ttft` seconds after arrival and its
    i-th later token `ttft + i * tbt` seconds after arrival: cumulative deadlines, so a
    slow token can be made up by faster ones. `priority` (higher is more important)
    breaks ties when the cache binds: lower-priority requests are preempted first."""

    ttft: float
    tbt: float
    priority: int = 0

    def __post_init__(self) -> None:
        for name in ("ttft", "tbt"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an int, got {self.priority!r}")

    def deadline(self, arrival_time: float, token_index: int) -> float:
        """When token `token_index` (0: the first) is due."""
        return arrival_time + self.ttft + token_index * self.tbt

    def attained(self, arrival_time: float, token_times: Sequence[float], finished: bool) -> bool:
        """True when a finished request's every token arrived by its deadline."""
        return finished and bool(token_times) and \
            all(t <= self.deadline(arrival_time, i) for i, t in enumerate(token_times))


def qos_classes_from(value: object, field: str = "qos_classes") -> Mapping[str, QoSClass]:
    """A read-only {name: QoSClass} from a mapping whose values are QoSClass or dicts of
    its fields (a parsed JSON file); ValueError naming `field` otherwise."""
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"{field} must be a non-empty mapping of class name to QoSClass, got {value!r}")
    out = {}
    for name, cls in value.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{field}: class names must be non-empty strings, got {name!r}")
        if isinstance(cls, Mapping):
            unknown = set(cls) - {"ttft", "tbt", "priority"}
            if unknown or not {"ttft", "tbt"} <= set(cls):
                raise ValueError(f"{field}[{name!r}] needs keys ttft and tbt (and optionally priority), "
                                 f"got {sorted(cls)}")
            try:
                cls = QoSClass(**cls)
            except ValueError as exc:
                raise ValueError(f"{field}[{name!r}]: {exc}") from None
        if not isinstance(cls, QoSClass):
            raise ValueError(f"{field}[{name!r}] must be a QoSClass, got {type(cls).__name__}")
        out[name] = cls
    return FrozenMap(out)


def check_qos_settings(qos_classes: object, default_qos: object,
                       qos_policy: object) -> Mapping[str, QoSClass] | None:
    """The classes as qos_classes_from makes them, once default_qos names one of them
    and qos_policy is known (the checks SchedulerConfig and EngineConfig share)."""
    if qos_policy not in QOS_POLICIES:
        raise ValueError(f"qos_policy must be one of {QOS_POLICIES}, got {qos_policy!r}")
    if qos_classes is None:
        if default_qos is not None:
            raise ValueError(f"default_qos {default_qos!r} needs qos_classes")
        return None
    classes = qos_classes_from(qos_classes)
    if default_qos is not None and default_qos not in classes:
        raise ValueError(f"default_qos must be one of {sorted(classes)}, got {default_qos!r}")
    return classes


def class_of(classes: Mapping[str, QoSClass] | None, default_qos: str | None,
             qos: str | None) -> tuple[str | None, QoSClass | None]:
    """A request's class name and class: `qos`, else `default_qos`; (None, None)
    without classes. ValueError naming qos for a name that is not a class, or for no
    name when classes have no default."""
    if qos is None:
        qos = default_qos
        if qos is None:
            if classes is not None:
                raise ValueError(f"qos is required: the scheduler has qos_classes {sorted(classes)} "
                                 "and no default_qos")
            return None, None
    if classes is None:
        raise ValueError(f"qos {qos!r} given, but the scheduler has no qos_classes")
    if qos not in classes:
        raise ValueError(f"qos must be one of {sorted(classes)}, got {qos!r}")
    return qos, classes[qos]

"""The token budget rule of the commands (`serve`, `bench`, `capacity`, `profile`): the
config tree's rule (`scheduler.config.resolve_token_budget`, which `LLM` and the
engine apply) plus the two choices only a command can make, because they need a
measured engine or a workload: --budget-rule slo-static and fixed."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from sarathi_rt.scheduler import get_policy
from sarathi_rt.scheduler.config import resolve_token_budget

BUDGET_RULES = ("adaptive", "slo-static", "fixed")
DEFAULT_BUDGET_TILE = 128


def add_budget_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("budget rule (with --tbt-slo)")
    g.add_argument("--budget-rule", choices=BUDGET_RULES, default=None,
                   help="adaptive (the default with --tbt-slo): each step sized to the SLO by a step-time model, "
                        "the token budget its cap; slo-static: one budget, the largest tile-aligned step within "
                        "the SLO, measured on the engine (or modelled by the simulator) at start; fixed: the token "
                        "budget as given, the SLO only measured (goodput)")
    g.add_argument("--budget-tile", type=int, default=None,
                   help=f"tile the slo-static budget is a multiple of (default {DEFAULT_BUDGET_TILE})")


@dataclass(frozen=True)
class Budget:
    """What a policy's scheduler gets: its token budget, and the TBT SLO its steps are
    sized to (None: a static budget)."""

    token_budget: int
    tbt_slo: float | None
    rule: str


def check_budget_flags(args: argparse.Namespace, token_budget: int | None, tbt_slo: float | None) -> str:
    """The budget rule the flags choose; contradictions are errors naming the flags."""
    rule = args.budget_rule
    if rule is not None and tbt_slo is None:
        raise ValueError(f"--budget-rule {rule} needs --tbt-slo")
    if rule == "slo-static" and token_budget is not None:
        raise ValueError("--budget-rule slo-static derives the token budget: drop --token-budget")
    if args.budget_tile is not None and rule != "slo-static":
        raise ValueError("--budget-tile is used only by --budget-rule slo-static")
    return rule or ("adaptive" if tbt_slo is not None else "fixed")


def resolve_budget(rule: str, token_budget: int | None, tbt_slo: float | None, policy: str, *, gpu: bool,
                   slo_static: Callable[[], int] | None = None, explicit_rule: bool = False) -> Budget:
    """One policy's budget under `rule`. A policy that cannot size steps to an SLO gets
    the fixed rule by default, and an error when the rule was asked for by name."""
    adaptive = get_policy(policy).adaptive
    if rule != "fixed" and not adaptive:
        if explicit_rule:
            raise ValueError(f"--budget-rule {rule} is not supported by policy {policy!r} (it is sarathi's)")
        rule = "fixed"
    if rule == "slo-static":
        if slo_static is None:
            raise ValueError("--budget-rule slo-static needs an engine or the simulator to measure steps")
        return Budget(slo_static(), None, rule)
    slo = tbt_slo if rule == "adaptive" else None
    return Budget(resolve_token_budget(token_budget, slo, policy, gpu=gpu), slo, rule)

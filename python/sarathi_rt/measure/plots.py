"""PNG plots for benchmarks and planning. Figures are built without pyplot, so
plotting never touches a display or global state."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping, Sequence

from matplotlib.figure import Figure

from sarathi_rt.measure.metrics import StepMetrics

if TYPE_CHECKING:
    from sarathi_rt.sim.budget import BudgetChoice, StepTimeCurve
    from sarathi_rt.sim.capacity import CapacityResult

PathLike = str | os.PathLike[str]


def _save(fig: Figure, path: PathLike) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _finish(ax, path: PathLike, **labels: str) -> None:
    ax.set(**labels)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    _save(ax.figure, path)


def plot_tbt_cdf(tbts: Mapping[str, Sequence[float]], path: PathLike, tbt_slo: float | None = None) -> None:
    """CDF of time-between-tokens, one line per policy (log-scaled time axis)."""
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    for policy, values in tbts.items():
        xs = sorted(v * 1e3 for v in values)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=policy)
    if tbt_slo is not None:
        ax.axvline(tbt_slo * 1e3, color="gray", linestyle="--", label="TBT SLO")
    ax.set_xscale("log")
    _finish(ax, path, xlabel="time between tokens (ms)", ylabel="fraction of tokens", title="TBT CDF")


def plot_tokens_per_step(steps: Mapping[str, Sequence[StepMetrics]], path: PathLike) -> None:
    """Tokens per step over time, one panel per policy, prefill and decode stacked."""
    fig = Figure(figsize=(7.5, 2.2 * max(1, len(steps))))
    for i, (policy, records) in enumerate(steps.items()):
        ax = fig.add_subplot(len(steps), 1, i + 1)
        if records:
            # One polygon per series (not one bar per step): thousands of steps plot fast.
            t0 = records[0].start_time
            xs, dec, tot = [], [], []
            for s in records:
                a, b = s.start_time - t0, s.start_time - t0 + s.duration
                xs += [a, a, b, b]
                dec += [0, s.num_decode_tokens, s.num_decode_tokens, 0]
                tot += [0, s.num_tokens, s.num_tokens, 0]
            ax.fill_between(xs, 0, dec, color="tab:blue", linewidth=0, label="decode")
            ax.fill_between(xs, dec, tot, color="tab:orange", linewidth=0, label="prefill")
        ax.set(ylabel="tokens", title=policy)
        ax.legend(loc="upper right", fontsize="small")
    fig.axes[-1].set_xlabel("time (s)")
    _save(fig, path)


def plot_step_time(profile: StepTimeCurve, choice: BudgetChoice, path: PathLike) -> None:
    """Measured T(n) with the SLO, its margin and the chosen token budget."""
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    ax.plot(profile.num_tokens, [s * 1e3 for s in profile.seconds], marker="o", markersize=3, label="T(n)")
    ax.axhline(choice.tbt_slo * 1e3, color="red", linestyle="--", label="TBT SLO")
    ax.axhline(choice.tbt_slo * (1 - choice.margin) * 1e3, color="orange", linestyle=":",
               label=f"SLO - {choice.margin:.0%} margin")
    ax.plot([choice.token_budget], [choice.step_time * 1e3], marker="*", markersize=14, color="green",
            label=f"budget {choice.token_budget}", linestyle="none")
    _finish(ax, path, xlabel="tokens per step", ylabel="step time (ms)",
            title=f"step time ({profile.num_decodes} decodes at context {profile.context_len}) {profile.label}")


def plot_capacity(results: Mapping[str, CapacityResult], tbt_slo: float | None, path: PathLike) -> None:
    """P99 TBT against QPS for every probe of each policy's capacity search (and the
    SLO's line, if the search had one)."""
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    for policy, result in results.items():
        probes = sorted(result.probes, key=lambda p: p.qps)
        ax.plot([p.qps for p in probes], [p.tbt_p99 * 1e3 for p in probes], marker="o",
                label=f"{policy} (capacity {result.max_qps:.3g} QPS)")
    if tbt_slo is not None:
        ax.axhline(tbt_slo * 1e3, color="gray", linestyle="--", label="TBT SLO")
    ax.set_yscale("log")
    _finish(ax, path, xlabel="load (QPS)", ylabel="P99 TBT (ms)", title="P99 TBT vs load")

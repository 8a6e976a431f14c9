"""The roofline of a step: what a step of the model must compute and read, and how far
the measured step is from the machine's two limits (bench/bench_roofline_cpu.py measures
both and the steps).

The compute bound counts 2 FLOPs per weight of every matrix a token goes through: the
layers' projections for every token, the LM head only for the rows that produce logits
(a decode's one token; a prefill chunk's last token when it samples). Attention's own
FLOPs (4 x context x head_dim per head per token) are left out: at the contexts the
bench runs they are a few percent of the projections' and they are bound by reading the
KV, which the memory bound counts. The memory bound reads every weight once per step
(the step's GEMMs see each weight once whatever the batch) and every row's KV up to its
new tokens, and writes the new tokens' KV.

Torch-free: the simulator's side of the project may import it."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sarathi_rt.utils.checks import positive_int

# The 1-minute load average is an exponentially weighted mean of the runnable tasks over
# the last minute (time constant 60 s).
_LOADAVG_TAU_S = 60.0
# A machine is busy when other work needs more than this many of the cores our threads do
# not use: half a core of noise (a shell, a daemon) is not other work.
BUSY_MARGIN = 0.5


@dataclass(frozen=True)
class ModelCost:
    """What one token costs the model: `layer_params` weights in the layers' matrices
    (every token), `head_params` in the LM head (every logits row), `weight_bytes` of all
    the weights (read once per step) and `kv_bytes_per_token` of K and V over all layers."""

    layer_params: int
    head_params: int
    weight_bytes: int
    kv_bytes_per_token: int

    def __post_init__(self) -> None:
        for name in ("layer_params", "head_params", "weight_bytes", "kv_bytes_per_token"):
            positive_int(name, getattr(self, name))


@dataclass(frozen=True)
class StepRow:
    """One request of a step: `num_tokens` new tokens after `context` cached ones;
    `logits`: the step computes its last token's logits."""

    context: int
    num_tokens: int
    logits: bool


def step_flops(cost: ModelCost, rows: Sequence[StepRow]) -> int:
    """The compute bound's FLOPs of a step: 2 x weights x tokens, per matrix."""
    if not rows:
        raise ValueError("rows must hold at least one request")
    tokens = sum(r.num_tokens for r in rows)
    logit_rows = sum(1 for r in rows if r.logits)
    return 2 * (cost.layer_params * tokens + cost.head_params * logit_rows)


def step_bytes(cost: ModelCost, rows: Sequence[StepRow]) -> int:
    """The memory bound's bytes of a step: the weights once, each row's KV read up to
    and including its new tokens, the new tokens' KV written."""
    if not rows:
        raise ValueError("rows must hold at least one request")
    if any(r.context < 0 or r.num_tokens < 1 for r in rows):
        raise ValueError("every row needs context >= 0 and num_tokens >= 1")
    kv_read = sum(r.context + r.num_tokens for r in rows)
    kv_written = sum(r.num_tokens for r in rows)
    return cost.weight_bytes + cost.kv_bytes_per_token * (kv_read + kv_written)


def own_load(threads: int, seconds: float) -> float:
    """How much of the 1-minute load a run of `threads` busy threads for `seconds` adds
    by its end (the load average's exponential decay, from zero)."""
    if threads < 1 or seconds < 0:
        raise ValueError(f"threads must be >= 1 and seconds >= 0, got {threads!r}, {seconds!r}")
    return threads * (1.0 - math.exp(-seconds / _LOADAVG_TAU_S))


def busy_warning(load_before: float, load_after: float, *, cores: int, threads: int, run_seconds: float
                 ) -> str | None:
    """A warning line when other work shared the machine with the run, else None.

    Other work is the load before the run, and the load after it less what the run's own
    threads added (`own_load`). It is too much when it exceeds the cores the run does not
    use by more than BUSY_MARGIN: then the run's threads shared cores."""
    if cores < 1 or threads < 1:
        raise ValueError(f"cores and threads must be >= 1, got {cores!r}, {threads!r}")
    other = max(load_before, load_after - own_load(threads, run_seconds))
    limit = max(0, cores - threads) + BUSY_MARGIN
    if other <= limit:
        return None
    return (f"WARNING: busy machine: other work's 1-minute load was {other:.2f} (before {load_before:.2f}, "
            f"after {load_after:.2f}) on {cores} cores with {threads} thread(s) of ours (limit {limit:.2f}); "
            "these figures are from a busy machine, not the machine's limits")

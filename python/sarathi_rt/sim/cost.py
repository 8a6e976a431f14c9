"""Cost models: how long one step (a BatchPlan) takes on a device, without running it.

* `LinearCostModel`: fixed + per-token seconds, for tests and back-of-envelope runs.
* `TableCostModel`: T(n) measured on this machine by `harness.step_timing.measure_step_curve`.
* `VidurCostModel`: per-operation GPU times measured by vidur (`mlp.csv`) plus an
  attention term from FLOPs and KV bytes with stated peak numbers and efficiencies.
"""
from __future__ import annotations

import bisect
import csv
import gzip
import io
import itertools
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol, Sequence

from sarathi_rt.scheduler import BatchPlan
from sarathi_rt.step_time.shape import PlannedStep, StepShape
from sarathi_rt.utils.checks import positive_int

from .hardware import A100, Hardware, get_hardware, infer_hardware


class CostModel(Protocol):
    def step_time(self, plan: BatchPlan) -> float:
        """Seconds for one step of `plan` on the whole model (one pipeline stage holds
        1/stages of the layers)."""

    def comm_time(self, num_tokens: int) -> float:
        """Seconds to send the activations of `num_tokens` tokens to the next pipeline stage."""


class ShapeCost:
    """A cost model that reads only the step's shape. It is also the simulator's step-time
    model for the adaptive budget (exact by construction, so it learns nothing and the
    budget holds no margin back for its error)."""

    margin = 0.0

    def predict_shape(self, shape: StepShape) -> float:
        raise NotImplementedError

    def predict_bound(self, shape: StepShape) -> float:
        """The most a step of this shape or one with fewer tokens takes (StepTimeModel).
        This is predict_shape for a model monotone in every count; the models read from
        measured points override it (TokenPeak)."""
        return self.predict_shape(shape)

    def step_time(self, plan: BatchPlan) -> float:
        return self.predict_shape(StepShape.of_plan(plan))

    def observe(self, plan: PlannedStep, seconds: float) -> None:
        """Nothing to learn: the simulator's steps take what this model says."""


def interpolate_measured(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """y at x from sorted measured points: linear between the two measured neighbours
    only (so a tile staircase with points on both sides of each step survives), ys[0]
    below the first point, and proportional to x beyond the last (large GEMMs are
    linear in their row count)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class TokenPeak:
    """The most f takes at any token count up to n, for an f of the token count that is
    linear between measured points `xs` (values `ys` there; constant below the first,
    rising beyond the last): f(n) or f at a measured point below n, whichever is larger.
    The running max of ys is computed once. Measured step times are not monotone between
    points (the GEMM library changes kernels), and a step sized for n tokens may hold
    fewer, so this is what a size must fit by."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        self._xs = list(xs)
        self._peak = list(itertools.accumulate(ys, max))

    def at_most(self, n: int, f_n: float) -> float:
        """The most f takes at counts up to n, given f_n = f(n)."""
        i = bisect.bisect_left(self._xs, n)  # the points strictly below n
        return f_n if i == 0 else max(f_n, self._peak[i - 1])


@dataclass(frozen=True)
class LinearCostModel(ShapeCost):
    """T(plan) = fixed_s + per_token_s * num_tokens; comm_s per pipeline hop."""

    fixed_s: float = 0.01
    per_token_s: float = 1e-4
    comm_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_token_s", "comm_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    def predict_shape(self, shape: StepShape) -> float:
        return self.fixed_s + self.per_token_s * shape.num_tokens

    def comm_time(self, num_tokens: int) -> float:
        return self.comm_s


class TableCostModel(ShapeCost):
    """Step time interpolated from measured (num_tokens, seconds) points, e.g. a
    `StepTimeCurve`. The points were taken with representative decode counts and
    context lengths, so the model depends on the token count only."""

    def __init__(self, num_tokens: Sequence[int], seconds: Sequence[float], comm_s: float = 0.0) -> None:
        if len(num_tokens) != len(seconds) or not num_tokens:
            raise ValueError("num_tokens and seconds must be non-empty and of equal length")
        pairs = sorted(zip(num_tokens, seconds))
        if any(a[0] == b[0] for a, b in zip(pairs, pairs[1:])) or pairs[0][0] <= 0:
            raise ValueError("num_tokens must be distinct positive ints")
        if any(not s > 0 for _, s in pairs):
            raise ValueError("seconds must all be > 0")
        self._xs = [float(n) for n, _ in pairs]
        self._ys = [float(s) for _, s in pairs]
        self.comm_s = comm_s
        self._peak = TokenPeak(self._xs, self._ys)

    def predict_shape(self, shape: StepShape) -> float:
        return interpolate_measured(self._xs, self._ys, shape.num_tokens)

    def predict_bound(self, shape: StepShape) -> float:
        return self._peak.at_most(shape.num_tokens, self.predict_shape(shape))

    def comm_time(self, num_tokens: int) -> float:
        return self.comm_s


# Every per-layer op in vidur's mlp.csv; `add` (the residual add) runs twice a layer.
_SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size")
_LAYER_OPS = {"input_layernorm": 1, "attn_pre_proj": 1, "attn_rope": 1, "attn_post_proj": 1,
              "post_attention_layernorm": 1, "mlp_up_proj": 1, "mlp_act": 1, "mlp_down_proj": 1,
              "add": 2}


class VidurCostModel(ShapeCost):
    """Step time for a LLaMA-style model from vidur's measured per-op GPU times.

    Linear layers, norms, rope and activation: the sum of the ops' median times at
    the step's token count (duplicate measurements of one count are averaged;
    `interpolate_measured` between counts), times num_layers, plus the embedding.
    Attention, per layer, is a roofline over the whole batch: max(FLOPs /
    (peak_flops * attn_flops_eff), KV bytes / (mem_bw * attn_bw_eff)), where a query
    at position p attends to p + 1 keys (4 * head_dim FLOPs per query head and key)
    and every request reads its K and V once. The LM head is a GEMM over the tokens
    that sample, at gemm_eff of peak. Tensor parallelism picks the profile's rows for
    `tp` workers, splits heads, and adds two ring all-reduces per layer.

    hardware: a `Hardware` or preset name; None takes the GPU the profile's path names
    (``h100_...mlp.csv``), else the A100 that vidur's bundled profiles were taken on.
    """

    def __init__(self, profile_path: str, num_layers: int = 32, tp: int = 1, hardware: Hardware | str | None = None,
                 attn_flops_eff: float = 0.5, attn_bw_eff: float = 0.7, gemm_eff: float = 0.7,
                 dtype_bytes: int = 2) -> None:
        positive_int("num_layers", num_layers)
        for name, eff in (("attn_flops_eff", attn_flops_eff), ("attn_bw_eff", attn_bw_eff),
                          ("gemm_eff", gemm_eff)):
            if not 0 < eff <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {eff!r}")
        rows = _read_profile(profile_path)
        tps = sorted({int(r["num_tensor_parallel_workers"]) for r in rows})
        if tp not in tps:
            raise ValueError(f"tp={tp!r} is not in profile {profile_path!r} (it has {tps})")
        rows = [r for r in rows if int(r["num_tensor_parallel_workers"]) == tp]
        shape = rows[0]
        if hardware is None:
            hardware = infer_hardware(profile_path) or A100
        self.num_layers, self.tp, self.hw = num_layers, tp, get_hardware(hardware)
        self.n_head = int(shape["n_head"]) // tp
        self.n_kv_head = max(1, int(shape["n_kv_head"]) // tp)
        self.hidden = int(shape["n_embd"])
        self.head_dim = self.hidden // int(shape["n_head"])
        self.vocab = int(shape["vocab_size"])
        self.intermediate = int(shape["n_expanded_embd"])
        self._full_kv_heads = int(shape["n_kv_head"])
        self._gated = str(shape.get("use_gated_mlp", "True")).lower() in ("true", "1")
        self.attn_flops_eff, self.attn_bw_eff, self.gemm_eff = attn_flops_eff, attn_bw_eff, gemm_eff
        self.dtype_bytes = dtype_bytes
        layer, emb = defaultdict(list), defaultdict(list)
        for r in rows:
            n = int(r["num_tokens"])
            layer[n].append(sum(k * float(r[f"time_stats.{op}.median"]) for op, k in _LAYER_OPS.items()))
            emb[n].append(float(r["time_stats.emb.median"]))
        self._xs = [float(n) for n in sorted(layer)]
        self._layer_s = [1e-3 * sum(layer[n]) / len(layer[n]) for n in sorted(layer)]
        self._emb_s = [1e-3 * sum(emb[n]) / len(emb[n]) for n in sorted(emb)]
        self._dense_cache: dict[int, float] = {}
        self._dense_peak = TokenPeak(self._xs, [self.dense_time(int(x)) for x in self._xs])

    def kv_cache_blocks(self, block_size: int = 16, mem_bytes: float | None = None, utilization: float = 0.9,
                        pipeline_stages: int = 1) -> int:
        """KV blocks that fit beside the weights when each GPU of mem_bytes (default: the
        hardware's memory) holds one TP shard of 1/pipeline_stages of the layers (every
        stage holds the same blocks)."""
        if mem_bytes is None:
            mem_bytes = self.hw.mem_bytes
        h, kv = self.hidden, self._full_kv_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + (3 if self._gated else 2) * h * self.intermediate
        weights = (self.num_layers * per_layer + 2 * self.vocab * h) * self.dtype_bytes / self.tp / pipeline_stages
        per_token = 2 * self.num_layers * self.n_kv_head * self.head_dim * self.dtype_bytes / pipeline_stages
        free = mem_bytes * utilization - weights
        if free < per_token * block_size:
            raise ValueError(f"mem_bytes={mem_bytes:.3g} leaves no room for the KV cache "
                             f"beside {weights / 1e9:.1f} GB of weights")
        return int(free // (per_token * block_size))

    def dense_time(self, num_tokens: int) -> float:
        """Everything but attention and the LM head, for `num_tokens` tokens."""
        t = self._dense_cache.get(num_tokens)
        if t is None:
            t = self.num_layers * interpolate_measured(self._xs, self._layer_s, num_tokens) + \
                interpolate_measured(self._xs, self._emb_s, num_tokens)
            if self.tp > 1:
                nbytes = num_tokens * self.hidden * self.dtype_bytes
                t += 2 * self.num_layers * 2 * (self.tp - 1) / self.tp * nbytes / self.hw.allreduce_bw
            self._dense_cache[num_tokens] = t
        return t

    def attention_and_head_time(self, shape: StepShape) -> tuple[float, float]:
        """(attention, LM head) seconds of a step of this shape."""
        hw = self.hw
        keys = shape.chunk_pairs + shape.decode_kv  # (query, key) pairs; a decode's own query sees s + 1 keys
        flops = 4 * self.n_head * self.head_dim * keys
        nbytes = 2 * (shape.prefill_kv + shape.decode_kv) * self.n_kv_head * self.head_dim * self.dtype_bytes
        attention = self.num_layers * max(flops / (hw.peak_flops * self.attn_flops_eff),
                                          nbytes / (hw.mem_bw * self.attn_bw_eff))
        head = 2 * shape.num_sampled * self.hidden * self.vocab / self.tp / (hw.peak_flops * self.gemm_eff)
        return attention, head

    def predict_shape(self, shape: StepShape) -> float:
        # The measured times already hold the tile staircase: no padding is added.
        return self.dense_time(shape.num_tokens) + sum(self.attention_and_head_time(shape))

    def predict_bound(self, shape: StepShape) -> float:
        # Attention and the LM head only grow with the step; the measured part may not.
        n = shape.num_tokens
        return self._dense_peak.at_most(n, self.dense_time(n)) + sum(self.attention_and_head_time(shape))

    def comm_time(self, num_tokens: int) -> float:
        return self.hw.link_latency_s + num_tokens * self.hidden * self.dtype_bytes / self.hw.link_bw


def _read_profile(path: str) -> list[dict[str, str]]:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as raw:
            rows = list(csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8", newline="")))
    except (OSError, UnicodeDecodeError) as e:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"profile {path!r} cannot be read: {e}") from None
    counts = ("num_tokens", "num_tensor_parallel_workers") + _SHAPE_COLUMNS
    times = ("time_stats.emb.median",) + tuple(f"time_stats.{op}.median" for op in _LAYER_OPS)
    if not rows:
        raise ValueError(f"profile {path!r} has no rows below its header")
    if not set(counts + times) <= rows[0].keys():
        raise ValueError(f"profile {path!r} is not a vidur mlp.csv: missing columns "
                         f"{sorted(set(counts + times) - rows[0].keys())}")
    # Every cell the model reads, checked here: a bad one would otherwise surface as a
    # NaN step time or a bare "could not convert" deep in a simulation.
    for line, r in enumerate(rows, start=2):  # line 1 is the header
        for col in counts + times:
            try:
                ok = int(r[col]) > 0 if col in counts else 0 <= float(r[col]) < math.inf
            except (TypeError, ValueError):
                ok = False
            if not ok:
                kind = "a positive integer" if col in counts else "a finite time >= 0"
                raise ValueError(f"profile {path!r} line {line}: {col} is {r[col]!r}, not {kind}")
    shapes = {tuple(int(r[c]) for c in _SHAPE_COLUMNS) for r in rows}
    if len(shapes) > 1:
        raise ValueError(f"profile {path!r} mixes models ({', '.join(_SHAPE_COLUMNS)}: {sorted(shapes)}): "
                         f"one model per profile")
    n_head, n_kv_head, n_embd = shapes.pop()[:3]
    if n_embd % n_head or n_head % n_kv_head:
        raise ValueError(f"profile {path!r}: n_embd={n_embd} must split into n_head={n_head} heads, "
                         f"in groups of n_kv_head={n_kv_head}")
    return rows

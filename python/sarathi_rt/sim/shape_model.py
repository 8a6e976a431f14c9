"""A cost model measured from the engine itself (`sarathi-rt profile`), that reads the
step's shape instead of its token count.

T(step) = host + G(num_tokens) + a_pairs * prefill (query, key) pairs
          + a_kv * KV tokens read + a_sampled * rows sampled + head * [any row sampled]

G is the dense part (projections, MLP, norms) as a function of the rows in the step:
piecewise linear between grid points placed at every token count of a pure (decode-
only or prefill-only) measured batch, so the non-monotonic small-batch cost of the CPU
GEMMs survives, proportional beyond the last. The mixed batches get no grid points of
their own: they share G with the pure ones, so they test and constrain the other terms
instead of each fitting itself exactly. `head` is the fixed cost of running the LM head
at all: a step that samples one row or more reads the whole [vocab, hidden] weight once
(65 MB for cpu-small), a prefill chunk that does not finish its prompt skips it. Without
it the decode-only batches (which always sample) would teach G that cost, and the hybrid
steps of a chunk beside a few decodes would come out short.
G's grid values, the a_* and head are fitted together, all >= 0, by least squares to
the profile's measured steps: decodes on a dense grid at two contexts, prefill chunks
at two contexts, and mixed steps. `host` is the engine's per-step time outside the
model (scheduling, inputs, outputs), measured by the profile on a short real run.
"""
from __future__ import annotations

import bisect
import json
import os
import statistics
from dataclasses import asdict, dataclass, field

import numpy as np

from sarathi_rt.step_time.shape import StepShape
from sarathi_rt.step_time.online import fit_nonnegative

from .cost import ShapeCost, TokenPeak


@dataclass(frozen=True)
class MeasuredStep:
    """One profiled batch: a prefill chunk of num_prefill_tokens from prefill_context
    (sampling when `prefill_samples`) beside num_decodes decodes over decode_context
    cached tokens each; seconds: the executor's wall time of each repeat."""

    num_prefill_tokens: int
    prefill_context: int
    num_decodes: int
    decode_context: int
    prefill_samples: bool
    seconds: tuple[float, ...]

    def shape(self) -> StepShape:
        q, s, d = self.num_prefill_tokens, self.prefill_context, self.num_decodes
        return StepShape(q, q * s + q * (q + 1) // 2 if q else 0, s + q if q else 0, d, d * (self.decode_context + 1),
                         d + (1 if q and self.prefill_samples else 0))

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


@dataclass(frozen=True)
class ShapeProfile:
    """What `sarathi-rt profile` saves. engine: the engine settings it was taken with
    (num_kv_blocks among them, so a simulation gets the same cache)."""

    steps: tuple[MeasuredStep, ...]
    host_overhead_s: float
    engine: dict = field(default_factory=dict)
    label: str = ""

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            json.dump({"kind": "sarathi-rt step profile", **asdict(self)}, f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ShapeProfile:
        try:
            with open(path) as f:
                d = json.load(f)
            steps = tuple(MeasuredStep(**{**s, "seconds": tuple(s["seconds"])}) for s in d["steps"])
            return cls(steps, float(d["host_overhead_s"]), d.get("engine", {}), d.get("label", ""))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"profile {os.fspath(path)!r} is not a sarathi-rt step profile: {e}") from None

    def spread(self) -> float:
        """Median over batches of (max - min) / median of the repeats: the timer's noise."""
        return statistics.median((max(s.seconds) - min(s.seconds)) / s.median for s in self.steps)


class ShapeCostModel(ShapeCost):
    """`time_scale`: the machine's speed when the simulated run happens relative to this
    profile's fit (shape_profiling.speed_factor before a run, run_speed during one): every
    predicted time is multiplied by it. A shared CPU's speed drifts by tens of percent
    within minutes, and a fit to a profile taken in a fast minute predicts a run in a slow
    one too short."""

    def __init__(self, profile: ShapeProfile, comm_s: float = 0.0, time_scale: float = 1.0) -> None:
        if len(profile.steps) < 4:
            raise ValueError(f"profile has {len(profile.steps)} measured steps; at least 4 are needed")
        if not time_scale > 0 or time_scale == float("inf"):
            raise ValueError(f"time_scale must be a positive finite number, got {time_scale!r}")
        self.profile, self.comm_s, self.host_s = profile, comm_s, profile.host_overhead_s * time_scale
        shapes = [s.shape() for s in profile.steps]
        self._grid = sorted({sh.num_tokens for sh in shapes if not (sh.num_prefill_tokens and sh.num_decodes)})
        if not self._grid:
            raise ValueError("profile has no decode-only or prefill-only batch to place the dense grid on")
        x = np.array([self._features(sh) for sh in shapes])
        y = np.array([s.median for s in profile.steps])
        coef = _nonnegative_lstsq(x, y) * time_scale
        g = len(self._grid)
        self._g = coef[:g].tolist()
        self.a_pairs, self.a_kv, self.a_sampled, self.head_s = coef[g:].tolist()
        self._dense_peak = TokenPeak(self._grid, self._g)  # G at its grid points

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ShapeCostModel:
        return cls(ShapeProfile.load(path))

    def _dense_weights(self, n: int) -> list[tuple[int, float]]:
        """(grid index, weight) of G(n) as a combination of the grid values."""
        xs = self._grid
        if n <= xs[0]:
            return [(0, 1.0)]
        if n >= xs[-1]:
            return [(len(xs) - 1, n / xs[-1])]
        i = bisect.bisect_left(xs, n)
        if xs[i] == n:
            return [(i, 1.0)]
        w = (n - xs[i - 1]) / (xs[i] - xs[i - 1])
        return [(i - 1, 1.0 - w), (i, w)]

    def _features(self, sh: StepShape) -> list[float]:
        row = [0.0] * len(self._grid)
        for i, w in self._dense_weights(sh.num_tokens):
            row[i] = w
        return row + [sh.chunk_pairs, sh.prefill_kv + sh.decode_kv, sh.num_sampled, float(sh.num_sampled > 0)]

    def dense_time(self, num_tokens: int) -> float:
        return sum(self._g[i] * w for i, w in self._dense_weights(num_tokens))

    def model_time(self, shape: StepShape) -> float:
        """The executor's time for a step of this shape (no host overhead)."""
        return self.dense_time(shape.num_tokens) + self._shape_time(shape)

    def _shape_time(self, shape: StepShape) -> float:
        """Everything but G: attention, the KV read, sampling and the LM head."""
        return self.a_pairs * shape.chunk_pairs + self.a_kv * (shape.prefill_kv + shape.decode_kv) + \
            self.a_sampled * shape.num_sampled + (self.head_s if shape.num_sampled else 0.0)

    def predict_shape(self, shape: StepShape) -> float:
        return self.host_s + self.model_time(shape)

    def predict_bound(self, shape: StepShape) -> float:
        # G keeps the measured small-batch dips; every other term grows with the step.
        n = shape.num_tokens
        return self.host_s + self._dense_peak.at_most(n, self.dense_time(n)) + self._shape_time(shape)

    def comm_time(self, num_tokens: int) -> float:
        return self.comm_s


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares in relative error (rows weighted by 1/y, so short steps count as
    much as long ones) with every coefficient >= 0."""
    w = 1.0 / y
    return fit_nonnegative(x * w[:, None], y * w)

"""The engine's step-time model: learned online from the steps it runs, so the adaptive
token budget (SchedulerConfig.tbt_slo) can size each step to the TBT target on any
machine without a profile.

Step time is a linear function of the step's shape (StepShape): a fixed cost, the rows
of causal chunks (prefill chunks and the draft rows a verifying decode adds: both are
queries over a context and themselves, so one coefficient prices both), their (query,
key) attention pairs, decodes, KV tokens read and rows sampled,
fitted by least squares with non-negative coefficients over a sliding window of recent
steps. The prediction is that fit plus a high quantile of its recent errors (each
measured before the step was learned from), so the budget guards the P99 step, not the
mean one. An error is counted as a share of its step's size, the size being the fit's
time for the step but never less than the median of recent steps: a step slowed by a
busy machine takes a share longer, so an absolute guard learned on a quiet phase of small
steps under-guards the large steps of a burst; yet a tiny step's jitter (the host's, the
timer's) is no share of its own size, and a purely relative guard would inflate every
forecast by it. The errors come from the last `error_window` steps only, so that a change
of load shows in the guard within a few steps rather than after hundreds. Until it has seen enough steps, and for steps larger than any it has seen, it
scales the largest step seen linearly with the token count: it starts conservative and
lets the budget grow as it learns."""
from __future__ import annotations

import math
import numpy as np

from .shape import PlannedStep, StepShape


def features(shape: StepShape) -> list[float]:
    return [1.0, shape.chunk_tokens, shape.chunk_pairs, shape.num_decodes,
            shape.prefill_kv + shape.decode_kv, shape.num_sampled]


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |x c - y| subject to c >= 0 (Lawson-Hanson active set; columns are scaled
    first so that the fit is conditioned)."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    n = x.shape[1]
    coef = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(xs).sum()))
    for _ in range(3 * n):
        grad = xs.T @ (y - xs @ coef)
        if passive.all() or grad[~passive].max() <= tol:
            break
        passive[np.flatnonzero(~passive)[np.argmax(grad[~passive])]] = True
        while True:
            trial = np.zeros(n)
            trial[passive] = np.linalg.lstsq(xs[:, passive], y, rcond=None)[0]
            if (trial[passive] > 0).all():
                coef = trial
                break
            # Step from coef toward trial until the first coefficient hits zero; drop it.
            neg = passive & (trial <= 0)
            alpha = np.min(coef[neg] / (coef[neg] - trial[neg]))
            coef = coef + alpha * (trial - coef)
            passive &= coef > tol
    return coef / scale


class OnlineStepTimeModel:
    """quantile: of the recent errors (as shares of step size) added to the fit (0.99
    guards P99 TBT);
    window: steps the fit remembers; error_window: steps whose errors make the guard;
    min_observations: steps seen before the fit is trusted.

    margin: the adaptive budget sizes steps to 90% of the SLO on this model's forecasts.
    The guard is a quantile of errors already seen, so it trails a change of load (a
    burst, another process taking the cores) by up to error_window steps; on a shared
    CPU 2-4% of steps outran their forecast with the margin (bench/RESULTS.md, adaptive
    budget on the engine)."""

    margin = 0.1

    def __init__(self, quantile: float = 0.99, window: int = 512, min_observations: int = 16,
                 error_window: int = 128) -> None:
        if not 0 < quantile < 1:
            raise ValueError(f"quantile must be in (0, 1), got {quantile!r}")
        if not isinstance(window, int) or window < 8:
            raise ValueError(f"window must be an int >= 8, got {window!r}")
        if not isinstance(min_observations, int) or not 1 <= min_observations <= window:
            raise ValueError(f"min_observations must be an int in [1, window], got {min_observations!r}")
        if not isinstance(error_window, int) or not 8 <= error_window <= window:
            raise ValueError(f"error_window must be an int in [8, window], got {error_window!r}")
        self.quantile, self.min_observations = quantile, min_observations
        # Ring buffers, row num_observed % window written next: the fit reads them as they
        # are (row order does not matter to least squares), so a refit copies no deque.
        self._x = np.zeros((window, len(features(StepShape()))))
        self._y = np.zeros(window)
        self._errors = np.zeros(error_window)
        self._sizes = np.zeros(error_window)  # the fit's time of those steps
        self._num_errors = 0
        self._typical = 0.0  # median of _sizes: the smallest size an error is a share of
        self._coef: list[float] | None = None
        self._guard = 0.0
        self._largest = (0, 0.0)  # (tokens, seconds) of the largest step seen
        self.num_observed = 0

    def _mean(self, shape: StepShape) -> float:
        assert self._coef is not None
        # Six products in Python: cheaper than a numpy call, and the speculation rule and
        # the adaptive budget ask it several times a step.
        return sum(c * f for c, f in zip(self._coef, features(shape)))

    def _scaled_largest(self, num_tokens: int) -> float:
        tokens, seconds = self._largest
        return math.inf if tokens == 0 else seconds * max(1.0, num_tokens / tokens)

    def predict_shape(self, shape: StepShape) -> float:
        warm = self._coef is not None and self.num_observed >= self.min_observations
        if not warm:
            return self._scaled_largest(shape.num_tokens)
        mean = self._mean(shape)
        t = mean + self._guard * max(mean, self._typical)
        if shape.num_tokens > self._largest[0]:  # beyond what it has seen: no extrapolating down
            t = max(t, self._scaled_largest(shape.num_tokens))
        return t

    def predict_bound(self, shape: StepShape) -> float:
        """The forecast: the fit's coefficients are >= 0 and the guard and the scaling
        of the largest step grow with the step, so it is monotone in every count."""
        return self.predict_shape(shape)

    def observe(self, plan: PlannedStep, seconds: float) -> None:
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        if not plan.entries:
            return
        shape = StepShape.of_plan(plan)
        if self._coef is not None:
            mean = self._mean(shape)
            size = max(mean, self._typical)
            if size > 0:
                slot = self._num_errors % len(self._errors)
                self._sizes[slot] = mean
                self._errors[slot] = (seconds - mean) / size
                self._num_errors += 1
        tokens, largest = self._largest
        if shape.num_tokens > tokens or (shape.num_tokens == tokens and seconds > largest):
            self._largest = (shape.num_tokens, seconds)
        row = self.num_observed % len(self._y)
        self._x[row] = features(shape)
        self._y[row] = seconds
        self.num_observed += 1
        # Refits get rarer once it is warm, and the guard and the typical size are derived
        # with them (from errors measured every step): a guard at most 7 steps old trails
        # a change of load by little beside error_window, and a step no longer pays for a
        # median and a quantile over the window.
        if self.num_observed <= 64 or self.num_observed % 8 == 0:
            seen = min(self.num_observed, len(self._y))
            self._coef = fit_nonnegative(self._x[:seen], self._y[:seen]).tolist()
            errors = min(self._num_errors, len(self._errors))
            if errors:
                self._typical = float(np.median(self._sizes[:errors]))
                self._guard = max(0.0, float(np.quantile(self._errors[:errors], self.quantile)))

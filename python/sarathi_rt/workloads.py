"""Serving workloads: when requests arrive and how long their prompts and outputs are.

Lengths come from real traces shipped in sarathi_rt/data (see data/README.md) or from
fixed/uniform synthetic distributions; arrivals are Poisson, gamma (bursty), evenly
spaced, or the trace's own timestamps. Two workloads share prompt prefixes and carry
(synthetic) token ids, for prefix caching: `system_prompt_workload` and
`multi_turn_workload`. Everything is seeded."""
from __future__ import annotations

import csv
import functools
import gzip
import io
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from sarathi_rt.utils.checks import positive_int
from sarathi_rt.utils.frozen import FrozenMap

if TYPE_CHECKING:
    import numpy as np

BUILTIN_TRACES = {
    "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv.gz",
    "arxiv": "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv.gz",
    "splitwise": "splitwise_conv.csv.gz",
}
ARRIVALS = ("poisson", "gamma", "fixed", "trace")
SYNTHETIC_LENGTHS = ("fixed", "uniform")


@dataclass(frozen=True)
class Trace:
    """Request lengths (and, for some traces, arrival times in seconds and the per-token
    acceptance rate of each request's speculative drafts) in trace order."""

    name: str
    num_prompt_tokens: np.ndarray
    num_decode_tokens: np.ndarray
    arrival_times: np.ndarray | None = None
    acceptance: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.num_prompt_tokens)


@dataclass(frozen=True)
class RequestSpec:
    """One request; `prompt_token_ids` only where prompts share text (else None: the
    engine draws random ids, the simulator needs none). `qos`: its QoS class (None:
    the scheduler's default_qos). `acceptance`: the chance that each draft token of
    its speculative decoding is accepted, for the simulator (None: the simulator's
    acceptance distribution draws one)."""

    request_id: int
    arrival_time: float
    num_prompt_tokens: int
    num_decode_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None
    qos: str | None = None
    acceptance: float | None = None


def data_path(filename: str) -> str:
    """Path of a file shipped in sarathi_rt/data."""
    return str(resources.files("sarathi_rt") / "data" / filename)


def load_trace(name_or_path: str) -> Trace:
    """A built-in trace by name (see BUILTIN_TRACES) or a CSV (optionally .gz) with
    columns num_prefill_tokens, num_decode_tokens and optionally arrived_at and
    acceptance (each request's draft acceptance rate in [0, 1], for the simulator)."""
    if name_or_path in BUILTIN_TRACES:
        return _read_trace(data_path(BUILTIN_TRACES[name_or_path]), name_or_path)
    if not os.path.isfile(name_or_path):
        raise ValueError(f"trace must be one of {sorted(BUILTIN_TRACES)} or a CSV file path, "
                         f"got {name_or_path!r}")
    return _read_trace(os.path.abspath(name_or_path), os.path.basename(name_or_path))


@functools.lru_cache(maxsize=8)
def _read_trace(path: str, name: str) -> Trace:
    import numpy as np  # here, not at the top: importing this module stays cheap (no numpy)

    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as raw:
            rows = list(csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8", newline="")))
    except (OSError, UnicodeDecodeError) as e:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"trace {path!r} cannot be read as a CSV: {e}") from None
    if not rows:
        raise ValueError(f"trace {path!r} has no requests (no rows below a header)")
    if not {"num_prefill_tokens", "num_decode_tokens"} <= rows[0].keys():
        raise ValueError(f"trace {path!r} needs columns num_prefill_tokens,num_decode_tokens "
                         f"(and optionally arrived_at), got {sorted(k for k in rows[0] if k)}")
    try:
        prompt = np.array([int(float(r["num_prefill_tokens"])) for r in rows], dtype=np.int64)
        decode = np.array([int(float(r["num_decode_tokens"])) for r in rows], dtype=np.int64)
        arrivals = np.array([float(r["arrived_at"]) for r in rows]) if "arrived_at" in rows[0] else None
        acceptance = np.array([float(r["acceptance"]) for r in rows]) if "acceptance" in rows[0] else None
    except (TypeError, ValueError, OverflowError) as e:  # int(float("inf")) overflows
        raise ValueError(f"trace {path!r} has a cell that is not a finite number: {e}") from None
    if arrivals is not None and not np.isfinite(arrivals).all():
        raise ValueError(f"trace {path!r}: arrived_at must be finite numbers")
    if acceptance is not None and not ((acceptance >= 0) & (acceptance <= 1)).all():
        raise ValueError(f"trace {path!r}: acceptance must be rates in [0, 1]")
    if (prompt <= 0).any() or (decode <= 0).any():
        raise ValueError(f"trace {path!r} has a request with a non-positive token count")
    if arrivals is not None and (np.diff(arrivals) < 0).any():
        raise ValueError(f"trace {path!r}: arrived_at must be non-decreasing")
    for a in (prompt, decode, arrivals, acceptance):
        if a is not None:
            a.setflags(write=False)  # cached and shared between callers
    return Trace(name, prompt, decode, arrivals, acceptance)


@dataclass(frozen=True)
class WorkloadConfig:
    """How to build a workload.

    lengths: a built-in trace name, a trace CSV path, "fixed" (prompt_len/decode_len)
        or "uniform" (integers drawn from prompt_range/decode_range, inclusive).
    length_scale: trace lengths are multiplied by this (rounded, at least 1), to fit
        a small model or a CPU run.
    max_total_tokens: trace requests whose scaled prompt + decode exceed this are
        skipped (a model's context length).
    arrival: "poisson" at qps; "gamma" at qps with coefficient of variation `cv`
        (cv > 1 is burstier than Poisson); "fixed" evenly spaced at qps; "trace" the
        trace's own arrived_at times, rescaled to an average of qps.
    qos_mix: {class name: fraction} (fractions > 0 summing to 1): each request gets a
        class drawn at random in these proportions, from a stream of its own, so the
        lengths and arrivals are the same with and without a mix. None: no class.
    """

    num_requests: int = 100
    qps: float = 1.0
    arrival: str = "poisson"
    cv: float = 2.0
    lengths: str = "sharegpt"
    length_scale: float = 1.0
    prompt_len: int = 512
    decode_len: int = 128
    prompt_range: tuple[int, int] = (64, 1024)
    decode_range: tuple[int, int] = (16, 256)
    max_total_tokens: int | None = None
    seed: int = 0
    qos_mix: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        for name in ("num_requests", "prompt_len", "decode_len"):
            positive_int(name, getattr(self, name))
        if not (isinstance(self.qps, (int, float)) and self.qps > 0 and math.isfinite(self.qps)):
            raise ValueError(f"qps must be a positive finite number, got {self.qps!r}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if not self.cv > 0:
            raise ValueError(f"cv must be > 0, got {self.cv!r}")
        if not self.length_scale > 0:
            raise ValueError(f"length_scale must be > 0, got {self.length_scale!r}")
        for name in ("prompt_range", "decode_range"):
            lo, hi = getattr(self, name)
            if not (isinstance(lo, int) and isinstance(hi, int) and 0 < lo <= hi):
                raise ValueError(f"{name} must be (lo, hi) ints with 0 < lo <= hi, got {(lo, hi)!r}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2 or None, got {self.max_total_tokens!r}")
        if self.arrival == "trace" and self.lengths in SYNTHETIC_LENGTHS:
            raise ValueError(f"arrival='trace' needs a trace in lengths, got {self.lengths!r}")
        if self.qos_mix is not None:
            object.__setattr__(self, "qos_mix", FrozenMap(check_qos_mix(self.qos_mix)))
        if self.lengths not in SYNTHETIC_LENGTHS:
            load_trace(self.lengths)  # fail here, naming the value, not mid-benchmark


def check_qos_mix(mix: object) -> dict[str, float]:
    """`mix` as a dict, if it maps class names to fractions > 0 that sum to 1."""
    if not isinstance(mix, Mapping) or not mix:
        raise ValueError(f"qos_mix must be a non-empty mapping of class name to fraction, got {mix!r}")
    out = {}
    for name, frac in mix.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"qos_mix: class names must be non-empty strings, got {name!r}")
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not (0 < frac <= 1):
            raise ValueError(f"qos_mix[{name!r}] must be a fraction in (0, 1], got {frac!r}")
        out[name] = float(frac)
    if abs(math.fsum(out.values()) - 1.0) > 1e-6:
        raise ValueError(f"qos_mix fractions must sum to 1, got {math.fsum(out.values())!r}")
    return out


def make_workload(config: WorkloadConfig) -> list[RequestSpec]:
    """Requests with ids 0..n-1 in arrival order; the same config gives the same list."""
    import numpy as np  # here, not at the top: importing this module stays cheap (no numpy)

    rng = np.random.default_rng(config.seed)
    prompt, decode, trace_times, acceptance = _lengths(config, rng)
    n = config.num_requests
    if config.arrival == "poisson":
        arrivals = np.cumsum(rng.exponential(1.0 / config.qps, n))
    elif config.arrival == "gamma":
        shape = 1.0 / config.cv ** 2  # mean shape*scale = 1/qps, cv = 1/sqrt(shape)
        arrivals = np.cumsum(rng.gamma(shape, 1.0 / (config.qps * shape), n))
    elif config.arrival == "fixed":
        arrivals = np.arange(n) / config.qps
    else:
        assert trace_times is not None
        arrivals = _rescale(trace_times - trace_times[0], config.qps)
    arrivals = arrivals - arrivals[0]  # the first request arrives at t = 0
    classes: list[str | None] = [None] * n
    if config.qos_mix is not None:
        names, fracs = list(config.qos_mix), np.array(list(config.qos_mix.values()))
        picks = np.random.default_rng([config.seed, 1]).choice(len(names), n, p=fracs / fracs.sum())
        classes = [names[k] for k in picks]
    rates = [None] * n if acceptance is None else [float(a) for a in acceptance]
    return [RequestSpec(i, float(arrivals[i]), int(prompt[i]), int(decode[i]), qos=classes[i], acceptance=rates[i])
            for i in range(n)]


def _lengths(config: WorkloadConfig, rng: np.random.Generator
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Prompt and decode lengths, the trace's arrival times (arrival="trace") and its
    acceptance rates (when it has them), for config.num_requests requests."""
    import numpy as np  # here, not at the top: importing this module stays cheap (no numpy)

    n = config.num_requests
    if config.lengths == "fixed":
        return np.full(n, config.prompt_len), np.full(n, config.decode_len), None, None
    if config.lengths == "uniform":
        (pl, ph), (dl, dh) = config.prompt_range, config.decode_range
        return rng.integers(pl, ph + 1, n), rng.integers(dl, dh + 1, n), None, None
    trace = load_trace(config.lengths)
    if config.arrival == "trace" and trace.arrival_times is None:
        raise ValueError(f"arrival='trace' but trace {config.lengths!r} has no arrived_at column")
    prompt = np.maximum(1, np.rint(trace.num_prompt_tokens * config.length_scale)).astype(np.int64)
    decode = np.maximum(1, np.rint(trace.num_decode_tokens * config.length_scale)).astype(np.int64)

    def rates(at: np.ndarray) -> np.ndarray | None:
        return None if trace.acceptance is None else trace.acceptance[at]

    keep = np.ones(len(trace), dtype=bool)
    if config.max_total_tokens is not None:
        keep = prompt + decode <= config.max_total_tokens
    idx = np.flatnonzero(keep)
    if len(idx) == 0:
        raise ValueError(f"no request of trace {config.lengths!r} fits max_total_tokens="
                         f"{config.max_total_tokens} at length_scale={config.length_scale}: its "
                         f"{len(trace)} requests hold {int((prompt + decode).min())} tokens or more")
    if config.arrival == "trace":
        # Trace order keeps lengths paired with their timestamps.
        if n > len(idx):
            raise ValueError(f"num_requests ({n}) exceeds the {len(idx)} usable requests of trace "
                             f"{config.lengths!r}, which arrival='trace' replays once")
        idx = idx[:n]
        return prompt[idx], decode[idx], trace.arrival_times[idx], rates(idx)  # type: ignore[index]
    picks = rng.permutation(idx)[:n] if n <= len(idx) else rng.choice(idx, n)
    return prompt[picks], decode[picks], None, rates(picks)


def _rescale(times: np.ndarray, qps: float) -> np.ndarray:
    import numpy as np  # here, not at the top: importing this module stays cheap (no numpy)

    span = times[-1] - times[0]
    if len(times) < 2 or span <= 0:
        return np.arange(len(times)) / qps
    return times * ((len(times) - 1) / span) / qps


def _ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(3, vocab_size, n).tolist()  # 0..2 are left to special tokens


def _check_counts(**values: int) -> None:
    for name, value in values.items():
        positive_int(name, value)


def system_prompt_workload(num_requests: int, qps: float, *, num_system_prompts: int = 4,
                           system_len: int = 1024, user_range: tuple[int, int] = (32, 128),
                           decode_range: tuple[int, int] = (16, 128), vocab_size: int = 32000,
                           seed: int = 0) -> list[RequestSpec]:
    """Poisson arrivals at `qps`; each prompt is one of `num_system_prompts` fixed texts
    of `system_len` tokens (picked at random) followed by a user message of a length
    drawn from `user_range`. Ids are in arrival order."""
    import numpy as np  # here, not at the top: importing this module stays cheap (no numpy)
    _check_counts(num_requests=num_requests, num_system_prompts=num_system_prompts, system_len=system_len,
                  vocab_size=vocab_size)
    if not (isinstance(qps, (int, float)) and qps > 0 and np.isfinite(qps)):
        raise ValueError(f"qps must be a positive finite number, got {qps!r}")
    rng = np.random.default_rng(seed)
    systems = [_ids(rng, system_len, vocab_size) for _ in range(num_system_prompts)]
    arrivals = np.cumsum(rng.exponential(1.0 / qps, num_requests))
    arrivals -= arrivals[0]
    out = []
    for i in range(num_requests):
        prompt = systems[int(rng.integers(num_system_prompts))] + \
            _ids(rng, int(rng.integers(user_range[0], user_range[1] + 1)), vocab_size)
        out.append(RequestSpec(i, float(arrivals[i]), len(prompt),
                               int(rng.integers(decode_range[0], decode_range[1] + 1)), tuple(prompt)))
    return out


def multi_turn_workload(num_conversations: int, qps: float, *, turns: int = 4, first_len: int = 256,
                        user_range: tuple[int, int] = (32, 128), decode_range: tuple[int, int] = (32, 128),
                        think_time: float = 10.0, vocab_size: int = 32000, seed: int = 0) -> list[RequestSpec]:
    """Conversations start as a Poisson process at `qps`; each has `turns` requests, a
    turn arriving an exponential `think_time` (mean, seconds) after the previous one.
    Every turn re-sends the conversation so far: the previous prompt, the previous
    answer (synthetic ids of its decode length) and a new user message."""
    import numpy as np  # here, not at the top: importing this module stays cheap (no numpy)
    _check_counts(num_conversations=num_conversations, turns=turns, first_len=first_len, vocab_size=vocab_size)
    if not (isinstance(qps, (int, float)) and qps > 0 and np.isfinite(qps)):
        raise ValueError(f"qps must be a positive finite number, got {qps!r}")
    if not think_time >= 0:
        raise ValueError(f"think_time must be >= 0, got {think_time!r}")
    rng = np.random.default_rng(seed)
    starts = np.cumsum(rng.exponential(1.0 / qps, num_conversations))
    starts -= starts[0]
    turns_out: list[tuple[float, list[int], int]] = []
    for start in starts:
        t, context = float(start), _ids(rng, first_len, vocab_size)
        for turn in range(turns):
            if turn:
                t += float(rng.exponential(think_time)) if think_time else 0.0
                context = context + _ids(rng, int(rng.integers(user_range[0], user_range[1] + 1)), vocab_size)
            decode = int(rng.integers(decode_range[0], decode_range[1] + 1))
            turns_out.append((t, context, decode))
            context = context + _ids(rng, decode, vocab_size)  # the answer, re-sent next turn
    turns_out.sort(key=lambda r: r[0])
    return [RequestSpec(i, t, len(p), d, tuple(p)) for i, (t, p, d) in enumerate(turns_out)]

"""What this CPU computes natively, and the rule that picks a CPU engine's dtype from it.

bfloat16 halves the bytes of weights and KV, but the GEMMs, which hold most of a step's
time, are only faster in bf16 on a CPU with bf16 arithmetic: AVX512-BF16
(`avx512_bf16`) or AMX (`amx_bf16`). Elsewhere torch converts every bf16 operand to
float32 in software and bf16 is 2-5x slower than float32 (bench/RESULTS.md). So:

- no dtype given: bfloat16 where the CPU has one of BF16_FLAGS, float32 elsewhere;
- dtype="bfloat16" on a CPU without them: float32, with one warning line that names
  the missing flags and how to force bf16, unless SARATHI_RT_CPU_BF16=emulate is set,
  which runs bf16 emulated (to match a GPU's numerics, or to test the bf16 path here);
- any other explicit dtype: as given.

Torch-free: the roofline model and the benches read the flags without loading torch."""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

# The x86 flags of native bfloat16 arithmetic (Linux /proc/cpuinfo spelling).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# SARATHI_RT_CPU_BF16=emulate: an explicit bfloat16 runs in bf16 on a CPU without BF16_FLAGS.
BF16_ENV = "SARATHI_RT_CPU_BF16"
BF16_EMULATE = "emulate"
CPUINFO = Path("/proc/cpuinfo")
# The rule in one line, for the command line's --dtype help.
DTYPE_HELP = (f"float32, bfloat16 or float16 (also bf16, fp16, half); default: on the CPU bfloat16 where it has "
              f"{' or '.join(BF16_FLAGS)}, else float32 ({BF16_ENV}={BF16_EMULATE} runs an explicit bfloat16 "
              "emulated), float32 on CUDA")


def cpu_flags(path: Path = CPUINFO) -> set[str]:
    """The first CPU's feature flags (empty where there is no /proc/cpuinfo or it lists
    no x86 flags: then no native bf16 is assumed)."""
    try:
        text = path.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def missing_bf16(flags: Iterable[str]) -> tuple[str, ...]:
    """The native-bf16 flags the CPU lacks: all of BF16_FLAGS when it has none (torch
    then emulates bf16), else none."""
    have = set(flags)
    return () if any(f in have for f in BF16_FLAGS) else BF16_FLAGS


def bf16_forced(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether SARATHI_RT_CPU_BF16=emulate asks for bf16 on a CPU without it. Any other
    non-empty value is a ValueError naming the variable (a typo must not pass silently)."""
    value = environ.get(BF16_ENV, "").strip().lower()
    if value not in ("", BF16_EMULATE):
        raise ValueError(f"{BF16_ENV} must be {BF16_EMULATE!r} or unset, got {environ[BF16_ENV]!r}")
    return value == BF16_EMULATE


def cpu_dtype(requested: str | None, flags: Iterable[str], forced: bool) -> tuple[str, str | None]:
    """(the dtype name a CPU engine computes in, a one-line warning or None) for a
    requested dtype name (None: not given), by the rule in the module docstring."""
    missing = missing_bf16(flags)
    if requested is None:
        return ("float32" if missing else "bfloat16"), None
    if requested != "bfloat16" or not missing or forced:
        return requested, None
    return "float32", (f"dtype=bfloat16 on a CPU without native BF16 (no {' or '.join(missing)} in "
                       f"{CPUINFO} flags): computing in float32, which is faster here; set "
                       f"{BF16_ENV}={BF16_EMULATE} to run bfloat16 emulated anyway")

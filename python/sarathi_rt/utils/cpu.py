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

SARATHI_RT_CPU_ISA=<level> makes this CPU behave as one of a lower ISA level (one of
ISA_LEVELS): the dtype rule sees only that level's flags and the native kernels run
that level's code, so a developer on an AVX-512/AMX host can run what an AVX2 host runs
(and CI can test both host kinds on either). It only lowers: a level the CPU lacks, or
an unknown one, is a ValueError naming the variable and the CPU's flags.

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
ISA_ENV = "SARATHI_RT_CPU_ISA"
# The levels, lowest first, each with the /proc/cpuinfo flags it adds to the ones below.
# "avx2" is x86-64-v3 and "avx512" x86-64-v4 (the levels the kernels are compiled for);
# the bf16 levels add the flags the dtype rule reads.
ISA_LEVELS: dict[str, tuple[str, ...]] = {
    "base": (),
    "avx2": ("avx2", "fma", "f16c", "bmi2"),
    "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_bf16", "amx_tile"),
}
# The level name the native kernels take for each level (only the bf16 attention kernel
# has avx512_bf16 code; none has AMX code, so "amx" runs the avx512_bf16 level).
KERNEL_LEVEL = {"base": "base", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512_bf16",
                "amx": "avx512_bf16"}
# The rule in one line, for the command line's --dtype help.
DTYPE_HELP = (f"float32, bfloat16 or float16 (also bf16, fp16, half); default: on the CPU bfloat16 where it has "
              f"{' or '.join(BF16_FLAGS)}, else float32 ({BF16_ENV}={BF16_EMULATE} runs an explicit bfloat16 "
              "emulated); on CUDA bfloat16 (float16 before SM 8.0)")


def _cpuinfo_field(name: str, path: Path) -> str | None:
    """The first CPU's `name` line's value in /proc/cpuinfo (None where there is no such
    file or line)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name):
            return line.split(":", 1)[1]
    return None


def native_flags(path: Path = CPUINFO) -> set[str]:
    """The first CPU's feature flags (empty where there is no /proc/cpuinfo or it lists
    no x86 flags: then no native bf16 is assumed)."""
    return set((_cpuinfo_field("flags", path) or "").split())


def is_amd(path: Path = CPUINFO) -> bool:
    """Whether the CPU is AMD's (its vendor_id): MKL, torch's float32 GEMM, runs slower
    code there, which decides the CPU linear's kernel (ops/linear.py)."""
    return "AuthenticAMD" in (_cpuinfo_field("vendor_id", path) or "")


def native_isa(flags: Iterable[str]) -> str:
    """The highest of ISA_LEVELS whose flags (and those of every level below) are in `flags`."""
    have, level = set(flags), "base"
    for name, needs in ISA_LEVELS.items():
        if not have.issuperset(needs):
            break
        level = name
    return level


def isa_level(flags: Iterable[str], environ: Mapping[str, str] = os.environ) -> str:
    """The ISA level this process runs at: SARATHI_RT_CPU_ISA if set (checked against
    `flags`), else the CPU's own."""
    have = set(flags)
    native = native_isa(have)
    value = environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return native
    levels = list(ISA_LEVELS)
    shown = " ".join(sorted(f for needs in ISA_LEVELS.values() for f in needs if f in have)) or "none"
    if value not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(levels)} (or unset), got {environ[ISA_ENV]!r}; "
                         f"this CPU is {native} (flags: {shown})")
    if levels.index(value) > levels.index(native):
        lacking = [f for name in levels[levels.index(native) + 1:levels.index(value) + 1]
                   for f in ISA_LEVELS[name] if f not in have]
        raise ValueError(f"{ISA_ENV}={value} needs {' '.join(lacking)}, which this CPU lacks; it can only "
                         f"lower the level, and this CPU is {native} (flags: {shown})")
    return value


def level_flags(flags: Iterable[str], level: str) -> set[str]:
    """`flags` less those of every ISA level above `level`: what a CPU of that level shows."""
    above = list(ISA_LEVELS)[list(ISA_LEVELS).index(level) + 1:]
    return set(flags).difference(f for name in above for f in ISA_LEVELS[name])


def cpu_flags(path: Path = CPUINFO, environ: Mapping[str, str] = os.environ) -> set[str]:
    """The flags of the CPU this process behaves as: the first CPU's, less those above
    SARATHI_RT_CPU_ISA when it is set (a bad value raises, naming it)."""
    flags = native_flags(path)
    if not environ.get(ISA_ENV, "").strip():
        return flags
    return level_flags(flags, isa_level(flags, environ))


def kernel_isa(environ: Mapping[str, str] = os.environ) -> str | None:
    """The level the native kernels must be capped at (`_C.set_cpu_isa`), or None to run
    the CPU's own; called once when the core loads."""
    if not environ.get(ISA_ENV, "").strip():
        return None
    return KERNEL_LEVEL[isa_level(native_flags(), environ)]


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

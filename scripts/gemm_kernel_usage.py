"""Build-time helper: the registers each compiled CUTLASS GEMM kernel uses, from ptxas.

`capture -- <nvcc command>` runs one nvcc compile (CMake's compiler launcher for the GEMM
kernel sources, compiled with -Xptxas=-v), keeps ptxas's resource report in
`<object>.ptxas` and passes every other line of the compiler's stderr through.
`header --out FILE OBJECTS...` turns the reports of those objects into the C++ table the GEMM planner
reads (csrc/cpu/gemm_plan.cpp), so the occupancy it plans with is the kernels' own.

A kernel is identified by its CTA tile (threadblock GemmShape), which is unique per row
of the planner's table; a config's count is the maximum over its dtypes and output
variants, as any of them may run.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '(\w+)' for '(sm_\d+)a?'")
REGISTERS = re.compile(r"ptxas info\s*: Used (\d+) registers")
TILE = re.compile(r"GemmShapeILi(\d+)ELi(\d+)ELi(\d+)E")  # mangled GemmShape<M, N, K>


def parse(text: str) -> dict[tuple[int, int, int, int], int]:
    """{(sm, tile_m, tile_n, tile_k): registers} of the GEMM kernels in one ptxas report."""
    usage: dict[tuple[int, int, int, int], int] = {}
    kernel: tuple[int, int, int, int] | None = None
    for line in text.splitlines():
        entry = ENTRY.search(line)
        if entry:
            tile = TILE.search(entry.group(1))
            is_gemm = "cutlass6Kernel" in entry.group(1) and tile is not None
            kernel = (int(entry.group(2)[3:]), *map(int, tile.groups())) if is_gemm else None
            continue
        regs = REGISTERS.search(line)
        if regs and kernel is not None:
            usage[kernel] = max(usage.get(kernel, 0), int(regs.group(1)))
            kernel = None
    return usage


def capture(command: list[str]) -> int:
    out = Path(command[command.index("-o") + 1])
    proc = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    report = [line for line in proc.stderr.splitlines() if line.startswith("ptxas info") or line.startswith("    ")]
    others = [line for line in proc.stderr.splitlines() if line not in report]
    if others:
        print("\n".join(others), file=sys.stderr)
    if proc.returncode == 0:
        out.with_name(out.name + ".ptxas").write_text("\n".join(report) + "\n")
    return proc.returncode


def header(out: Path, objects: list[Path]) -> None:
    usage: dict[tuple[int, int, int, int], int] = {}
    reports = [obj.with_name(obj.name + ".ptxas") for obj in objects]
    for report in reports:
        for key, regs in parse(report.read_text()).items():
            usage[key] = max(usage.get(key, 0), regs)
    if not usage:
        raise SystemExit(f"no CUTLASS GEMM kernel found in the ptxas reports {[str(r) for r in reports]}")
    rows = "".join(f"    {{{sm}, {m}, {n}, {k}, {regs}}},\n" for (sm, m, n, k), regs in sorted(usage.items()))
    text = ("// Generated at build time by scripts/gemm_kernel_usage.py from ptxas -v of the GEMM kernels.\n"
            "#pragma once\n#include \"sarathi_rt/gemm_plan.h\"\n\nnamespace sarathi_rt {\n\n"
            "// {sm, tile_m, tile_n, tile_k, registers per thread}\n"
            "inline constexpr GemmKernelRegisters kCompiledGemmRegisters[] = {\n" + rows + "};\n\n"
            "}  // namespace sarathi_rt\n")
    if not out.exists() or out.read_text() != text:  # unchanged: no rebuild of the planner
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "capture" and sys.argv[2] == "--":
        return capture(sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=["header"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("objects", type=Path, nargs="+")
    args = parser.parse_args()
    header(args.out, args.objects)
    return 0


if __name__ == "__main__":
    sys.exit(main())

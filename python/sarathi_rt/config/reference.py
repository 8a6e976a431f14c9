"""docs/configuration.md, written from the config tree: every field with its flag, its
default and its help, and the defaults that depend on the device. The page is never
edited by hand: `python -m sarathi_rt.config.reference` rewrites it, and a test fails
when it differs from what the tree says."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from sarathi_rt.scheduler.config import ADAPTIVE_CAP, DEFAULT_MAX_NUM_SEQS, DEFAULT_TOKEN_BUDGET
from sarathi_rt.utils.options import FLAG, HELP

from .budget import BUDGET_RULES, DEFAULT_BUDGET_TILE
from .flags import flag_name
from .tree import SECTIONS

HEADER = """# Configuration reference

Generated from the config tree (`sarathi_rt.config`) by `python -m sarathi_rt.config.reference`;
edit the tree, not this page. Every field is one keyword of `LLM(...)` and
`EngineConfig(...)`, one key of a `--config FILE.json`, and one flag of `sarathi-rt serve`,
`bench`, `capacity`, `profile` and `generate`, with the same name, meaning and default
everywhere. A bad value is a `ValueError` naming the field and the value; settings that
contradict each other (a chunk size for a policy that does not chunk, the deadline QoS
policy for one that cannot size steps, a budget below one tile) are errors, never rewritten.
`bench` and `capacity` take `--policy` as a comma-separated list of policies to compare.
"""


def _default(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING:
        return "required"
    return "see help" if f.default is None else f"`{f.default}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    lines = [HEADER]
    for section in SECTIONS:
        lines += [f"## {section.SECTION}", "", section.__doc__.strip(), "",
                  "| field | flag | default | meaning |", "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(section):
            if f.metadata.get(FLAG, True):
                flag = f"`{flag_name(f.name)}`" + (f", `--no-{flag_name(f.name)[2:]}`" if isinstance(f.default, bool) else "")
                lines.append(f"| `{f.name}` | {flag} | {_default(f)} | {_cell(f.metadata[HELP])} |")
        lines.append("")
    lines += ["## Defaults that depend on the device", "",
              "| setting | CPU | GPU (and the simulator, which models one) |", "| --- | --- | --- |",
              f"| `token_budget`, no `tbt_slo` | {DEFAULT_TOKEN_BUDGET['cpu']} | {DEFAULT_TOKEN_BUDGET['gpu']} |",
              f"| `token_budget` with `tbt_slo` (the adaptive budget's cap) | {ADAPTIVE_CAP['cpu']} | "
              f"{ADAPTIVE_CAP['gpu']} |",
              f"| `max_num_seqs` | min({DEFAULT_MAX_NUM_SEQS}, token budget) | min({DEFAULT_MAX_NUM_SEQS}, token budget) |",
              "| `dtype` | bfloat16 with native BF16 (AVX512-BF16 or AMX), else float32 | bfloat16 from SM 8.0, "
              "else float16 |",
              "| `kv_memory_fraction` | 0.5 of MemAvailable, at most 4 GiB | 0.9 of free GPU memory |", "",
              "## The budget rule of the commands", "",
              "`serve`, `bench`, `capacity` and `profile` add `--budget-rule` "
              f"({', '.join(BUDGET_RULES)}) and `--budget-tile` (default {DEFAULT_BUDGET_TILE}), which only a "
              "command can apply: with `--tbt-slo`, `adaptive` (the default) sizes each step to the SLO with the "
              "token budget as its cap (as `LLM(tbt_slo=)` does); `slo-static` measures the engine (or models the "
              "simulated GPU) at start and keeps the largest tile-aligned step within the SLO; `fixed` keeps the "
              "token budget and only measures the SLO (goodput). A policy that cannot size steps (vllm, orca, "
              "request_level, decode_maximal) runs `fixed`.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    path = Path(argv[0] if argv else "docs/configuration.md")
    path.write_text(render())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

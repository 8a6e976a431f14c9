"""The scheduler, simulator and workloads embed without torch or matplotlib, and the
package root loads the engine only when LLM/ops are touched."""
import json
import subprocess
import sys

import pytest


def _modules_after(code: str) -> dict[str, bool]:
    probe = code + "\nimport json, sys\nprint(json.dumps({m: m in sys.modules for m in ('torch', 'matplotlib')}))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["sarathi_rt", "sarathi_rt.scheduler", "sarathi_rt.sim", "sarathi_rt.workloads",
                                    "sarathi_rt.sim.capacity", "sarathi_rt.sim.budget", "sarathi_rt.measure.metrics",
                                    "sarathi_rt.measure.slo", "sarathi_rt.measure.roofline", "sarathi_rt.step_time",
                                    "sarathi_rt.utils.cpu"])
def test_planning_modules_import_without_torch_or_matplotlib(module: str) -> None:
    assert _modules_after(f"import {module}") == {"torch": False, "matplotlib": False}


def test_root_metadata_stays_torch_free() -> None:
    code = "import sarathi_rt\nassert sarathi_rt.__version__ == sarathi_rt.build_info()['version']"
    assert _modules_after(code) == {"torch": False, "matplotlib": False}


def test_command_line_parses_without_torch() -> None:
    # Every subcommand registers its parser; only running a model loads torch, so
    # `sarathi-rt deploy` or `capacity --simulate` start in a fraction of a second.
    code = ("import argparse, importlib\nfrom sarathi_rt.cli import COMMANDS\n"
            "sub = argparse.ArgumentParser().add_subparsers()\n"
            "for name in COMMANDS:\n    importlib.import_module(f'sarathi_rt.commands.{name}').add_parser(sub)")
    assert _modules_after(code) == {"torch": False, "matplotlib": False}


@pytest.mark.slow  # imports torch and the engine in a fresh interpreter
def test_llm_and_ops_load_on_first_touch() -> None:
    code = "from sarathi_rt import LLM, SamplingParams, ops\nassert ops.linear and LLM and SamplingParams"
    assert _modules_after(code) == {"torch": True, "matplotlib": False}


def test_unknown_root_attribute_names_itself() -> None:
    import sarathi_rt

    with pytest.raises(AttributeError, match="no_such_thing"):
        sarathi_rt.no_such_thing  # noqa: B018

"""CI runs the README's two commands as written: the extraction .ci/run relies on finds them."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_main_then_test_command() -> None:
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / ".ci" / "readme_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main, test = module.readme_commands(ROOT / "README.md")
    assert "pip install ." in main and "python -m sarathi_rt" in main
    assert test == "bash scripts/test.sh" and (ROOT / "scripts" / "test.sh").is_file()
    assert "readme_commands.py README.md" in (ROOT / ".ci" / "run").read_text()

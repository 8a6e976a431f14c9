"""Prints the README's two commands, one a line: its first two ```bash blocks (the main
command, then the test command). .ci/run runs exactly these, so CI runs what users do."""
import re
import sys
from pathlib import Path


def readme_commands(readme: Path) -> list[str]:
    blocks = re.findall(r"^```bash\n(.*?)^```", readme.read_text(), flags=re.M | re.S)[:2]
    commands = [b.strip() for b in blocks]
    if len(commands) != 2 or any(not c or "\n" in c for c in commands):
        raise SystemExit(f"{readme}: the first two ```bash blocks must hold one command each, got {commands!r}")
    return commands


if __name__ == "__main__":
    print("\n".join(readme_commands(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("README.md"))))

#!/usr/bin/env bash
# Installs sarathi_rt with its test extras and runs the test suite (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q ".[test]"
python3 -c "import sarathi_rt, json; print(json.dumps(sarathi_rt.build_info()))"
python3 -m pytest -q -p no:cacheprovider tests "$@"

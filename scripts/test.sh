#!/usr/bin/env bash
# Installs sarathi_rt with its test extras and runs the test suite (the README's test command).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
# The build requirements are installed here and the build runs without isolation, so the
# CMake tree under build/ keeps pointing at tools that stay: a second run with no source
# change recompiles nothing.
mapfile -t build_requires < <(python3 - <<'PY'
import ast, re
text = open("pyproject.toml").read()
print("\n".join(ast.literal_eval(re.search(r"\[build-system\][^\[]*?requires = (\[[^\]]*\])", text).group(1))))
PY
)
python3 -m pip install -q "${build_requires[@]}"
python3 -m pip install -q --no-build-isolation ".[test]"
python3 - <<'PY'
import json, os, shutil

import sarathi_rt

info = sarathi_rt.build_info()
print(json.dumps(info))
# With nvcc on PATH and no explicit CPU-only build, the CUDA sources must have been compiled.
if shutil.which("nvcc") and os.environ.get("SARATHI_RT_CUDA", "auto") != "0" and not info["cuda_compiled"]:
    raise SystemExit("nvcc is on PATH but the core was built without CUDA")
PY
# Without arguments pytest runs the testpaths of pyproject.toml (tests/).
python3 -m pytest -q -p no:cacheprovider "$@"

#!/usr/bin/env bash
# Copies the CUTLASS/CuTe headers of the installed nvidia-cutlass package into
# .cutlass/include (git-ignored, ~27 MB), so the tree can be built on a machine with no
# internet (bench/device_check.sh uses them by default). Run it where nvidia-cutlass is
# installed: `bash scripts/stage_cutlass.sh [python]`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
SRC="$("$PY" -c 'import cutlass_library, pathlib; print(pathlib.Path(cutlass_library.__file__).parent / "source" / "include")')"
if [[ ! -f "$SRC/cutlass/version.h" ]]; then
  echo "stage_cutlass: no CUTLASS headers under $SRC (pip install nvidia-cutlass)" >&2
  exit 1
fi
rm -rf .cutlass/include
mkdir -p .cutlass
cp -r "$SRC" .cutlass/include
echo "stage_cutlass: $(du -sh .cutlass/include | cut -f1) of headers in .cutlass/include"

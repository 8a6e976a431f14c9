#!/usr/bin/env bash
# One-shot check on a GPU machine (sized for one H200, under 8 minutes): build the core
# from source with CUDA for sm_90a, run the CUDA tests, run every GPU benchmark, and
# print ONE summary table last. No internet is needed: the CUTLASS headers come from
# .cutlass/include (scripts/stage_cutlass.sh puts them there before the tree travels).
#
#   bash bench/device_check.sh            # env: SARATHI_RT_CUDA_ARCHS (default 90a),
#                                         #      SARATHI_RT_CUTLASS_DIR, PYTHON
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PYTHON="${PYTHON:-python3}"
export SARATHI_RT_CUDA=1
export SARATHI_RT_CUDA_ARCHS="${SARATHI_RT_CUDA_ARCHS:-90a}"
export SARATHI_RT_CUTLASS_DIR="${SARATHI_RT_CUTLASS_DIR:-$ROOT/.cutlass/include}"
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$ROOT/bench/out}"
mkdir -p "$OUT"
SUMMARY="$OUT/device_summary.jsonl"
: > "$SUMMARY"
status=0

# GPU benchmarks: each prints its rows and appends JSON lines to the file given by
# --summary (see bench/device_summary.py for the keys).
BENCHES=(
  bench/bench_attention_gpu.py
  bench/bench_attention_cost.py
  bench/bench_gemm_gpu.py
)

step() { echo; echo "=== $* ($(date +%T))"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'

step "build (SARATHI_RT_CUDA_ARCHS=$SARATHI_RT_CUDA_ARCHS)"
if [[ ! -f "$SARATHI_RT_CUTLASS_DIR/cutlass/version.h" ]]; then
  echo "no CUTLASS headers at $SARATHI_RT_CUTLASS_DIR: run scripts/stage_cutlass.sh before copying the tree" >&2
  exit 1
fi
start=$(date +%s)
"$PYTHON" setup.py -q build_ext --inplace || { echo "BUILD FAILED" >&2; exit 1; }
echo "build took $(( $(date +%s) - start )) s"
"$PYTHON" -c 'import json, sarathi_rt; print(json.dumps(sarathi_rt.build_info()))'

step "CUDA tests"
# Every test whose name, module or marker says cuda/gpu; they skip nothing here.
"$PYTHON" -m pytest -q -p no:cacheprovider -rs tests -k "cuda or gpu" || status=1

for bench in "${BENCHES[@]}"; do
  step "$bench"
  timeout 240 "$PYTHON" "$bench" --summary "$SUMMARY" || { echo "$bench FAILED" >&2; status=1; }
done

step "summary ($(date -u +%F), $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name())'))"
"$PYTHON" bench/device_summary.py "$SUMMARY"
exit $status

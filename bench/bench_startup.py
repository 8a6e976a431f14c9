"""Start-up of `LLM(model)` on a SmolLM2-135M-shaped float32 checkpoint (~540 MB of
safetensors, random weights), each run in a fresh process: where the time goes (import,
config, weights, KV cache, warm-up) and the peak RSS.

    python bench/bench_startup.py [--model DIR] [--repeats 5]

Without --model a checkpoint is written once to $TMPDIR/sarathi_rt_startup_ckpt. Target:
LLM(...) ready in under 5 s on 2 cores (the median of `total`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET_S = 5.0
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def make_checkpoint(path: Path, tiny: bool = False) -> None:
    """config.json + model.safetensors of the SmolLM2-135M shape (or the `tiny` preset's),
    random float32 weights."""
    import torch
    from safetensors.torch import save_file

    from sarathi_rt.models import ModelConfig, get_preset, hf_tensor_shapes

    config = get_preset("tiny") if tiny else ModelConfig(**SMOLLM2_135M)
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in hf_tensor_shapes(config)}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config.to_hf_dict()))


def measure(model: str) -> dict[str, float]:
    """One cold start in this (fresh) process."""
    import resource
    import time

    t0 = time.perf_counter()
    import sarathi_rt
    t1 = time.perf_counter()
    from sarathi_rt.models import resolve_model
    resolve_model(model)
    t2 = time.perf_counter()
    llm = sarathi_rt.LLM(model)
    t3 = time.perf_counter()
    worker = llm.engine.executor.worker
    return {"import": t1 - t0, "config": t2 - t1, **worker.startup_seconds, "LLM()": t3 - t2,
            "total": t3 - t0, "kv_cache_gib": worker.kv_cache.nbytes / 2**30,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a model directory (default: a generated SmolLM2-135M-shaped one)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny, seconds-long run of the same code path (the quick test lane runs it): "
                         "a checkpoint of the tiny preset's shape, one process")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.model)))
        return
    if args.smoke:
        args.repeats = 1
    model = args.model
    if model is None:
        model = str(Path(tempfile.gettempdir()) / ("sarathi_rt_startup_ckpt" + ("_tiny" if args.smoke else "")))
        if not (Path(model) / "model.safetensors").is_file():
            subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                            f"import bench_startup, pathlib; "
                            f"bench_startup.make_checkpoint(pathlib.Path({model!r}), tiny={args.smoke})"],
                           check=True)
    size = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) / 2**20
    runs = []
    for _ in range(args.repeats):
        out = subprocess.run([sys.executable, __file__, "--child", "--model", model], check=True,
                             capture_output=True, text=True, env=os.environ).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    print(f"LLM({model!r}): {size:.0f} MiB of safetensors, {args.repeats} fresh processes, median (min-max)")
    for key in runs[0]:
        values = [r[key] for r in runs]
        unit = "GiB" if key.endswith("_gib") else "s"
        print(f"  {key:>13}: {statistics.median(values):7.3f} {unit}  ({min(values):.3f}-{max(values):.3f})")
    total = statistics.median(r["total"] for r in runs)
    print(f"ready in {total:.2f} s (target {TARGET_S:.0f} s: {total / TARGET_S:.2f}x of target)")


if __name__ == "__main__":
    main()

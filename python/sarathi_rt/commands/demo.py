"""`sarathi-rt demo`: one mixed prefill+decode attention step through the paged KV cache,
checked against the float64 reference."""
from __future__ import annotations

import argparse
import time


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="run one hybrid attention step on random data")
    p.add_argument("--decodes", type=int, default=8, help="decode requests in the batch")
    p.add_argument("--chunk", type=int, default=128, help="prefill chunk length")
    p.add_argument("--context", type=int, default=512, help="tokens already cached per request")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch  # only for the commands that run kernels: `sarathi-rt deploy` starts without it

    import sarathi_rt
    from sarathi_rt import ops
    from sarathi_rt.ops import reference

    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 8, 2, 64, args.block_size
    lens = [(1, args.context + 1)] * args.decodes + [(args.chunk, args.context + args.chunk)]
    blocks_per_seq = -(-max(k for _, k in lens) // bs)
    k_cache = torch.zeros(blocks_per_seq * len(lens), bs, kv_heads, dim, device=args.device)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.randperm(k_cache.shape[0], device=args.device).int().view(len(lens), blocks_per_seq)
    for b, (_, kv_len) in enumerate(lens):
        pos = torch.arange(kv_len, device=args.device)
        slots = block_tables[b, pos // bs].long() * bs + pos % bs
        kv = torch.randn(2, kv_len, kv_heads, dim, device=args.device)
        ops.write_kv(kv[0], kv[1], k_cache, v_cache, slots)
    q = torch.randn(sum(q for q, _ in lens), heads, dim, device=args.device)
    cu = torch.tensor([0] + [q for q, _ in lens], device=args.device).cumsum(0).int()
    seqlens_k = torch.tensor([k for _, k in lens], dtype=torch.int32, device=args.device)

    start = time.perf_counter()
    out = ops.hybrid_attention(q, k_cache, v_cache, cu, seqlens_k, block_tables)
    elapsed = time.perf_counter() - start
    err = (out.double() - reference.hybrid_attention(q, k_cache, v_cache, cu, seqlens_k, block_tables)).abs().max()
    print(f"sarathi_rt {sarathi_rt.__version__} {sarathi_rt.build_info()}")
    print(f"one hybrid step: {args.decodes} decodes + a {args.chunk}-token chunk over {args.context} cached tokens "
          f"-> {tuple(out.shape)} in {elapsed * 1e3:.2f} ms; max |error| vs float64 reference = {err:.2e}")
    return 0 if err < 1e-4 else 1

"""Registers our ops with the PyTorch dispatcher so torch.compile and CUDA graphs see
them as opaque ops with known effects.

Every op here only writes into tensors it is given (mutates_args) and returns None, so a
fake implementation has nothing to compute. The kernels are registered straight for the
CPU and CUDA dispatch keys rather than through torch.library.custom_op: that skips its
autograd and view-tracking Python layers on every call, and its lazy import of
torch._dynamo on a process's first call (a second or more, paid again by every worker).

The public ops call torch.ops.sarathi_rt.<name>. The engine's model layers call the same
Python kernels through KERNELS, which skips the dispatcher: its round trip is paid on
every kernel call of every layer, which on the CPU is a visible share of a small model's
step (bench/RESULTS.md, step overhead)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch

_LIB = torch.library.Library("sarathi_rt", "DEF")
KERNELS = SimpleNamespace()  # KERNELS.<name> is what torch.ops.sarathi_rt.<name> runs


def _no_output(*args: object, **kwargs: object) -> None:
    return None


def native_op(name: str, mutates_args: tuple[str, ...]) -> Callable[[Callable[..., None]], object]:
    """`@native_op("write_kv", mutates_args=("k_cache", "v_cache"))` defines
    torch.ops.sarathi_rt.write_kv from a typed Python function, puts the function in
    KERNELS and returns the op."""

    def register(fn: Callable[..., None]) -> object:
        setattr(KERNELS, name, fn)
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        for dispatch_key in ("CPU", "CUDA"):
            _LIB.impl(name, fn, dispatch_key)
        torch.library.register_fake(f"sarathi_rt::{name}", _no_output, lib=_LIB)
        return getattr(torch.ops.sarathi_rt, name)

    return register

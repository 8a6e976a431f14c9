"""Torch-tensor ops backed by the C++/CUDA core. CPU and CUDA tensors share one API."""
from sarathi_rt.ops import reference
from sarathi_rt.ops.attention import hybrid_attention, write_kv

__all__ = ["hybrid_attention", "write_kv", "reference"]

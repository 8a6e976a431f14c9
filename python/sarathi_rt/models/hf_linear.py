"""The linear layers of a transformers-built model, on the engine's GEMM path (the
transformers backend calls `adopt_linears` once its weights are loaded).

Every plain `nn.Linear` runs `ops.linear.apply_linear`, as the native layers do: on the
CPU its rows are padded to a tile, so a token's result does not depend on what shares its
step (the batch invariance prefix caching and chunking rely on), and a weight too large
for the caches (the LM head) is streamed once per call instead of read at a fraction of
memory bandwidth by torch's GEMM.

Projections a decoder computes from one input (attention's q/k/v, a gated MLP's
gate/up) become one product over their weights stacked, each member returning its slice:
one wide GEMM instead of two or three narrow ones, as the native layers' qkv_proj and
gate_up_proj. The stacked weight is the members' only storage (each member's weight is a
view of it), so nothing is held twice. A member called with another input than the one
its siblings were called with computes the product again: the stacking never changes
what a call returns, only how many GEMMs it takes."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from sarathi_rt.ops.linear import apply_linear

# Sibling projections by attribute name on their parent module, the names transformers'
# decoders give them (Llama, Qwen, Gemma, Mistral, OLMo, Granite, Mixtral's shared MLPs...).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class EngineLinear(nn.Linear):
    """An nn.Linear (same parameters, same isinstance) computed by apply_linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(x, self.weight, self.bias)


@dataclass(eq=False)
class _Stack:
    """The stacked product of one group of sibling projections, shared by its members."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    bounds: list[tuple[int, int]]  # each member's rows of the stacked weight
    x: torch.Tensor | None = None  # the input of the product held in `out`
    out: torch.Tensor | None = None
    taken: set[int] = field(default_factory=set)  # members that took their slice of `out`

    def slice(self, member: int, x: torch.Tensor) -> torch.Tensor:
        # Identity, not equality: the siblings receive the very same tensor object. (No
        # version check: inference tensors keep no version counter, and transformers'
        # layers do not write into a projection's input between its siblings' calls.)
        if x is not self.x or member in self.taken:
            self.x, self.out, self.taken = x, apply_linear(x, self.weight, self.bias), set()
        self.taken.add(member)
        out = self.out
        if len(self.taken) == len(self.bounds):  # every member served: hold nothing past the layer
            self.x, self.out = None, None
        lo, hi = self.bounds[member]
        return out[..., lo:hi]


class StackedLinear(EngineLinear):
    """One member of a `_Stack`: its weight is a view of the stacked weight."""

    stack: _Stack
    member: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stack.slice(self.member, x)


def _stackable(members: list[nn.Module]) -> bool:
    return (all(type(m) is EngineLinear for m in members)
            and len({(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in members}) == 1)


def _stack(members: list[EngineLinear]) -> None:
    weight = torch.cat([m.weight.detach() for m in members])
    bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
    bounds, lo = [], 0
    for m in members:
        bounds.append((lo, lo + m.out_features))
        lo += m.out_features
    stack = _Stack(weight, bias, bounds)
    for i, (m, (lo, hi)) in enumerate(zip(members, bounds)):
        m.weight = nn.Parameter(weight[lo:hi], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[lo:hi], requires_grad=False)
        m.__class__ = StackedLinear
        m.stack, m.member = stack, i


def adopt_linears(model: nn.Module) -> None:
    """Move `model`'s plain nn.Linear layers onto apply_linear and stack its sibling
    projections (see the module). Changing each layer's class in place keeps its
    parameters, the ties transformers made between them (a tied LM head) and isinstance
    checks as they were; subclasses of nn.Linear (quantized layers) are left alone."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = EngineLinear
    for parent in model.modules():
        for names in SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            if all(isinstance(m, nn.Module) for m in members) and _stackable(members):
                _stack(members)

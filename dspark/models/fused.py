"""Projections that read the same input, computed as one product when serving.

A decoder layer's q, k and v projections read the same hidden state, and so do its MLP's
gate and up projections. At one or a few tokens per request a product is mostly fixed
cost, so one product over the stacked weights costs about what one of the parts does:
on dspark-small's shapes (width 256, one token, bfloat16, a 2-core CPU) q, k and v took
93 µs as three products and 42 µs as one. Serving engines keep such weights stacked;
here they are stacked after loading (`fuse_projections`: the engine fuses its
target, a neural drafter its own layers when bound to the target), and each layer's weight becomes
a view of the stacked tensor, so checkpoints, `state_dict`, `load_state_dict` and in-place
updates see the same parameters as before, with no second copy in memory.

The stacked product runs only without autograd (a gradient would reach the stacked tensor,
not the layers' parameters) and only while every layer still views it: after a `.to()` each
layer owns new storage, and the layers run apart until they are fused again.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Fused:
    """Linear layers over one input as one product; `fused(x)` -> each layer's output, in order."""

    def __init__(self, *layers: nn.Linear) -> None:
        biased = {layer.bias is not None for layer in layers}
        if len(biased) != 1 or len({layer.in_features for layer in layers}) != 1:
            raise ValueError("fuse layers of one input width that all have a bias or none")
        self.layers, self.sizes = layers, [layer.out_features for layer in layers]
        self.weight = torch.cat([layer.weight.detach() for layer in layers])
        self.bias = torch.cat([layer.bias.detach() for layer in layers]) if biased == {True} else None
        for layer, w in zip(layers, self.weight.split(self.sizes), strict=True):
            layer.weight.data = w
        if self.bias is not None:
            for layer, b in zip(layers, self.bias.split(self.sizes), strict=True):
                layer.bias.data = b  # type: ignore[union-attr]
        self.pointers = [layer.weight.data_ptr() for layer in layers]

    def usable(self) -> bool:
        """No autograd, and every layer's weight is still a view of the stacked tensor."""
        return not torch.is_grad_enabled() and all(
            layer.weight.data_ptr() == p for layer, p in zip(self.layers, self.pointers, strict=True))

    def __call__(self, x: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, ...]:
        """The outputs of layers[first:] (their stacked rows are contiguous: one product too)."""
        start = sum(self.sizes[:first])
        bias = self.bias[start:] if self.bias is not None else None
        return F.linear(x, self.weight[start:], bias).split(self.sizes[first:], -1)


def fuse_projections(module: nn.Module) -> None:
    """Stack the projections of every submodule whose class can (a `fuse_projections` method); idempotent."""
    for m in module.modules():
        if callable(getattr(type(m), "fuse_projections", None)):
            m.fuse_projections()


def owned(t: torch.Tensor) -> torch.Tensor:
    """t with storage of its own (a copy of a fused layer's view), as safetensors requires."""
    whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t.contiguous() if whole else t.clone(memory_format=torch.contiguous_format)

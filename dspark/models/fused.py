"""Projections that read the same input, computed as one product when serving.

A decoder layer's q, k and v projections read the same hidden state, and so do its MLP's
gate and up projections. At one or a few tokens per request a product is mostly fixed
cost, so one product over the stacked weights costs about what one of the parts does:
on dspark-small's shapes (width 256, one token, bfloat16, a 2-core CPU) q, k and v took
93 µs as three products and 42 µs as one. Serving engines keep such weights stacked;
here they are stacked after loading (`fuse_projections`: the engine fuses its
target, a neural drafter its own layers when bound to the target), and each layer's weight becomes
a view of the stacked tensor, so checkpoints, `state_dict`, `load_state_dict` and in-place
updates see the same parameters as before. Every product a served layer runs (the fused
ones, and the output, down and LM-head projections alone) goes through `Product`, which on
CPU keeps oneDNN's blocked copy of the weight beside it: the weights twice in memory, for a
product that does not re-block its weight on every call.

The stacked product runs only without autograd (a gradient would reach the stacked tensor,
not the layers' parameters) and only while every layer still views it: after a `.to()` each
layer owns new storage, and the layers run apart until they are fused again.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from dspark.models.buckets import bucket

ROWS = 32  # the most rows a product with a long reduction computes at once (`Product`)
LONG = 512  # inputs from which a reduction is long


@functools.cache
def _blockable_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes this CPU's oneDNN can block: float32, and bfloat16 where oneDNN has a bfloat16
    path (AVX512 or AVX-NE-CONVERT; an AVX2 CPU refuses to block it). Asked once, not per product."""
    if not torch.backends.mkldnn.is_available():
        return ()
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def packable(weight: torch.Tensor) -> bool:
    """Whether oneDNN can hold a blocked copy of this weight (on CPU, in a dtype it can block)."""
    return weight.device.type == "cpu" and weight.dtype in _blockable_dtypes()


class Product:
    """x @ weight.T + bias. On CPU through oneDNN's blocked copy of the weight, made once and
    again only after one of the layers' parameters changed in place (their version counters:
    `load_state_dict`, an optimizer step): the plain product re-blocks the weight on every
    call, which at a few rows costs more than the arithmetic when the weights stream from
    memory (dspark-small's 8192 x 256 LM head, bfloat16, one row: 92 µs plain, 43 µs blocked).
    Its rows are padded to a `bucket` size, whose kernel oneDNN has most likely built already.
    One float32 row keeps the plain product: there the blocked one made a plain decoding step
    no faster (AVX2 CPU). On CPU a product whose reduction is long (`LONG` inputs or more) runs at most
    `ROWS` rows at a time: on an AMX CPU (Intel Xeon, family 6, model 167) oneDNN rounded some rows
    of a bfloat16 product of 512 or more inputs otherwise once it had more than 32 rows (products
    of 256 and 384 inputs, and every product of up to 32 rows, gave each row what it gets alone,
    up to 1,024 rows), so a row's logits depended on what shared its step and greedy output under
    load on what else was served. The price: dspark-small's down projection (768 inputs) at 128 rows
    took 116 µs in chunks against 41 µs whole there; steps of up to 32 tokens pay nothing."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sources: list[torch.Tensor]) -> None:
        self.weight, self.bias, self.sources = weight, bias, sources
        self.packable = packable(weight)  # the weight's device and dtype never change (a `.to()` fuses anew)
        # a reduction whose CPU kernels round a row by how many share it (on CUDA nothing measured asks for chunks)
        self.long = weight.device.type == "cpu" and weight.shape[-1] >= LONG
        self.blocked: torch.Tensor | None = None
        self.versions: list[int] = []  # the sources' versions when blocked

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.long and x.numel() > ROWS * x.shape[-1]:  # a long reduction over many rows: ROWS at a time
            rows = x.reshape(-1, x.shape[-1])
            out = torch.cat([self.product(rows[i : i + ROWS]) for i in range(0, rows.shape[0], ROWS)])
            return out.view(*x.shape[:-1], out.shape[-1])
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T + bias as one kernel call."""
        if not self.blocks(x):
            return F.linear(x, self.weight, self.bias)
        self.refresh()
        n = x.shape[0]
        if x.dim() == 2 and bucket(n) == n:  # flat rows of a built size, the usual case, passed as they are:
            # the reshape, slice and view around the kernel made a 2-token verify step 1.2 ms slower (97 products)
            return torch.ops.mkldnn._linear_pointwise(x, self.blocked, self.bias, "none", [], "")
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        padded = bucket(n)  # zero rows up to a size whose kernel is built already (`models/buckets.py`)
        if padded > n:
            rows = torch.cat([rows, rows.new_zeros(padded - n, rows.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(rows, self.blocked, self.bias, "none", [], "")
        return out[:n].view(*x.shape[:-1], out.shape[-1])

    def blocks(self, x: torch.Tensor) -> bool:
        """Whether x goes through the blocked copy: no autograd, x in the weight's blockable
        dtype, and in float32 more than one row."""
        one_row = x.numel() == x.shape[-1]
        return (self.packable and x.dtype == self.weight.dtype and not torch.is_grad_enabled()
                and not (one_row and x.dtype == torch.float32))

    def refresh(self) -> None:
        """The blocked copy made anew when missing or when a source changed in place since."""
        versions = [p._version for p in self.sources]
        if self.blocked is not None and versions == self.versions:
            return
        self.blocked = torch.ops.mkldnn._reorder_linear_weight(self.weight)
        self.versions = versions


class Fused:
    """Linear layers over one input as one product; `fused(x)` -> each layer's output, in order.
    One layer alone keeps its weight (no copy) and gains the blocked product."""

    def __init__(self, *layers: nn.Linear) -> None:
        biased = {layer.bias is not None for layer in layers}
        if len(biased) != 1 or len({layer.in_features for layer in layers}) != 1:
            raise ValueError("fuse layers of one input width that all have a bias or none")
        self.layers, self.sizes = layers, [layer.out_features for layer in layers]
        if len(layers) == 1:  # nothing to stack (a tied LM head stays tied to the embedding's storage)
            self.weight, self.bias = layers[0].weight.detach(), _detached(layers[0].bias)
            self.pointers = [self.weight.data_ptr()]
            self.products = [Product(self.weight, self.bias, self.sources())]
            return
        self.weight = torch.cat([layer.weight.detach() for layer in layers])
        self.bias = torch.cat([layer.bias.detach() for layer in layers]) if biased == {True} else None
        for layer, w in zip(layers, self.weight.split(self.sizes), strict=True):
            layer.weight.data = w
        if self.bias is not None:
            for layer, b in zip(layers, self.bias.split(self.sizes), strict=True):
                layer.bias.data = b  # type: ignore[union-attr]
        self.pointers = [layer.weight.data_ptr() for layer in layers]
        starts = [sum(self.sizes[:i]) for i in range(len(layers))]
        self.products = [Product(self.weight[s:], self.bias[s:] if self.bias is not None else None, self.sources())
                         for s in starts]

    def sources(self) -> list[torch.Tensor]:
        return [p for layer in self.layers for p in (layer.weight, layer.bias) if p is not None]

    def current(self) -> bool:
        """Every layer's weight is still a view of the stacked tensor (no `.to()` since)."""
        return all(layer.weight.data_ptr() == p for layer, p in zip(self.layers, self.pointers, strict=True))

    def usable(self) -> bool:
        """No autograd, and the stacked weights are current."""
        return not torch.is_grad_enabled() and self.current()

    def __call__(self, x: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, ...]:
        """The outputs of layers[first:] (their stacked rows are contiguous: one product too)."""
        return self.products[first](x).split(self.sizes[first:], -1)

    def joined(self, x: torch.Tensor) -> torch.Tensor:
        """Every layer's output side by side on the last axis, as one tensor."""
        return self.products[0](x)


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.detach() if t is not None else None


def stamp(*tensors: torch.Tensor) -> tuple:
    """What a copy derived from these tensors must match to still hold: each one's storage, version counter
    (bumped by in-place writes: `load_state_dict`, an optimizer step) and dtype."""
    return tuple((t.data_ptr(), t._version, t.dtype) for t in tensors)


def refresh(fused: Fused | None, *layers: nn.Linear) -> Fused:
    """fused while its layers still view its weights, else the layers fused anew (whatever the
    autograd mode: fusing again keeps the blocked copies)."""
    return fused if fused is not None and fused.current() else Fused(*layers)


def outputs(fused: Fused | None, layers: tuple[nn.Linear, ...], x: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, ...]:
    """Each of layers[first:] applied to x: by the fused product where that is usable, else layer by layer."""
    if fused is not None and fused.usable():
        return fused(x, first)
    return tuple(layer(x) for layer in layers[first:])


def fuse_projections(module: nn.Module) -> None:
    """Stack the projections of every submodule whose class can (a `fuse_projections` method); idempotent."""
    for m in module.modules():
        if callable(getattr(type(m), "fuse_projections", None)):
            m.fuse_projections()


def owned(t: torch.Tensor) -> torch.Tensor:
    """t with storage of its own (a copy of a fused layer's view), as safetensors requires."""
    whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t.contiguous() if whole else t.clone(memory_format=torch.contiguous_format)

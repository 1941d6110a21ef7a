"""Drafters grown from trained ones: a change of shape that starts from what the old drafter computed.

A new stage of training can change a drafter's architecture without losing what it learned: every
weight that still fits is carried, and every new weight starts where it adds nothing (or nearly
nothing) to the old computation, so the first step continues from the old held-out acceptance.
- `grow`: more backbone layers (new output projections at zero);
- `with_context_residual`: the feature before the anchor into every block slot (projection at zero);
- `reheaded`: another sequential head (`markov` -> `gated` / `rnn` / `mlp`) or a wider rank r;
- `with_anchor_mlp`: an MLP of its own for the anchor slot (output projection at zero);
- `with_slot_mlp`: an MLP of its own for every block slot after every backbone layer (output projections at zero);
- `with_exit`: a decoder layer of its own for one-position proposals (`drafters/exit.py`; a copy of a backbone layer).
"""

from __future__ import annotations

import torch

from dspark.drafters.base import HEADS
from dspark.drafters.registry import new_drafter

OPEN_GATE = 6.0  # sigmoid(6) = 0.9975: a new gate starts open, passing the Markov embedding through


def rebuilt(drafter, **changes):
    """A drafter of the changed config holding every weight of `drafter` -> (it, the names of its new weights)."""
    bigger = new_drafter(drafter.config.replace(**changes))
    missing, unexpected = bigger.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected, unexpected
    return bigger, missing


def with_context_residual(drafter):
    """A copy of a DSpark/DFlash drafter that also reads the feature before the anchor into every block slot;
    its new projection starts at zero, so it computes exactly what it did until training moves it."""
    wider, missing = rebuilt(drafter, context_residual=True)
    assert missing == ["backbone.residual.weight"], missing
    return wider


def with_anchor_mlp(drafter, width: int):
    """A copy of a DSpark drafter whose anchor slot (the first proposal) also runs an MLP of its own on its final
    hidden; the MLP's output projection starts at zero, so it computes exactly what it did until training moves it."""
    if drafter.config.kind != "dspark" or drafter.config.anchor_mlp:
        raise ValueError(f"can give a dspark drafter without one an anchor MLP, not a {drafter.config.kind} drafter "
                         f"with anchor_mlp={drafter.config.anchor_mlp}")
    wider, missing = rebuilt(drafter, anchor_mlp=width)
    assert sorted(missing) == ["anchor.down_proj.weight", "anchor.gate_proj.weight", "anchor.up_proj.weight"], missing
    return wider


def with_slot_mlp(drafter, width: int):
    """A copy of a DSpark drafter whose block slots each run an MLP of their own after every backbone layer
    (`drafters/slots.py`); their output projections start at zero, so it computes exactly what it did until training
    moves them."""
    if drafter.config.kind != "dspark" or drafter.config.slot_mlp:
        raise ValueError(f"can give a dspark drafter without them slot MLPs, not a {drafter.config.kind} drafter "
                         f"with slot_mlp={drafter.config.slot_mlp}")
    wider, missing = rebuilt(drafter, slot_mlp=width)
    assert all(k.startswith("backbone.slot_mlps.") for k in missing), missing
    return wider


def grow(drafter, num_layers: int):
    """A deeper copy of a DSpark/DFlash drafter that computes exactly what it did: its layers
    first, then new layers whose output projections (attention o_proj, MLP down_proj) start at
    zero, so each new layer adds nothing to the residual stream until training moves it."""
    old = drafter.config.num_layers
    if drafter.config.kind not in ("dspark", "dflash") or num_layers < old:
        raise ValueError(f"can grow a dspark/dflash backbone deeper, not a {drafter.config.kind} "
                         f"drafter from {old} to {num_layers} layers")
    deeper, missing = rebuilt(drafter, num_layers=num_layers)
    assert all(k.startswith("backbone.layers.") for k in missing), missing
    with torch.no_grad():
        for layer in deeper.backbone.layers[old:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return deeper


def reheaded(drafter, head: str, rank: int):
    """A copy of a DSpark drafter with another sequential head kind and/or a rank at least as wide.

    Backbone and confidence weights are carried; the old W1 / W2 fill the first r columns of the
    new ones, whose other W2 columns (and confidence weights on them) start at zero, so a wider
    Markov head computes exactly the old bias. A `gated` head starts with its gate open (bias
    `OPEN_GATE`, weights zero): the bias of the Markov head it grows from, scaled by 0.9975. An
    `rnn` head starts with its output reading the Markov embedding (W_o = [0; I; 0]) and its state
    closed: B = W2 tanh(W1[x]), the old bias where the embedding is small. An `mlp` head keeps the Markov head whole
    and its correction's output projection starts at zero: exactly the old bias."""
    cfg = drafter.config
    if cfg.kind != "dspark" or cfg.head != "markov" or head not in HEADS or head == "none" or rank < cfg.rank:
        raise ValueError(f"can rehead a dspark drafter's markov head to markov/gated/rnn/mlp at rank >= {cfg.rank}, "
                         f"not a {cfg.kind} drafter's {cfg.head!r} head to {head!r} at rank {rank}")
    new = new_drafter(cfg.replace(head=head, rank=rank))
    old_state, r, d = drafter.state_dict(), cfg.rank, cfg.hidden_size
    with torch.no_grad():
        for name, tensor in new.state_dict().items():
            if name in old_state and old_state[name].shape == tensor.shape:
                tensor.copy_(old_state[name])
        new.head.w1.weight[:, :r] = old_state["head.w1.weight"]
        new.head.w2.weight.zero_()
        new.head.w2.weight[:, :r] = old_state["head.w2.weight"]
        if new.conf is not None and cfg.confidence_markov:
            new.conf.proj.weight.zero_()
            new.conf.proj.weight[:, : d + r] = old_state["conf.proj.weight"]
        if head == "gated":
            new.head.gate.weight.zero_()
            new.head.gate.bias.fill_(OPEN_GATE)
        elif head == "rnn":
            new.head.cell.weight.zero_()
            new.head.cell.bias.zero_()
            new.head.cell.bias[:rank].fill_(OPEN_GATE)  # the gate keeps s = 0
            out = new.head.cell.weight[2 * rank :]  # [r, 2r + d]: the output rows
            out[:, rank : 2 * rank] = torch.eye(rank)
    return new


def with_exit(drafter, layer: int, width: int):
    """A copy of a DSpark drafter with an early exit (`drafters/exit.py`) whose layer runs after backbone layer
    `layer` and has an MLP of the given width. The exit starts as a copy of backbone layer `layer` (its MLP too where
    the widths agree; else that MLP's output starts at zero), of the final norm and of the confidence head: its one
    position is then the first `layer` + 1 backbone layers' anchor slot. The full block computes exactly what it did."""
    if drafter.config.kind != "dspark" or drafter.config.exit_mlp:
        raise ValueError(f"can give a dspark drafter without one an exit, not a {drafter.config.kind} drafter "
                         f"with exit_mlp={drafter.config.exit_mlp}")
    exited, missing = rebuilt(drafter, exit_layer=layer, exit_mlp=width)
    assert all(k.startswith("exit.") for k in missing), missing
    with torch.no_grad():
        source = {k: v for k, v in exited.backbone.layers[layer].state_dict().items()
                  if width == drafter.config.intermediate_size or not k.startswith("mlp.")}
        exited.exit.layer.load_state_dict(source, strict=False)
        if width != drafter.config.intermediate_size:
            exited.exit.layer.mlp.down_proj.weight.zero_()
        exited.exit.norm.weight.copy_(exited.backbone.norm.weight)
        if exited.exit.conf is not None:
            exited.exit.conf.load_state_dict(exited.conf.state_dict())
    return exited

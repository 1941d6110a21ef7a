"""The early exit: a one-position DSpark proposal from a layer of its own (`DrafterConfig.exit_mlp`, `exit_layer`).

Under load the scheduler drafts one position per request or none: each extra token verified costs about as much as
a plain one, and only the first draft is likely enough to pay. A one-position proposal of the full backbone still
runs every layer over every request's anchor slot, where MTP-1 runs one: side by side at 16 requests, one DSpark
position for every request was accepted as often as MTP's and ran 6% slower (`docs/models/dspark-small.md`). The exit
is one decoder layer of its own, with its own keys and values of the context (one more layer of the drafter's cache)
and an MLP of width `exit_mlp`, run on the anchor slot after the backbone's first `exit_layer` layers (0: on the
block's input, as MTP's layer reads its own), then a norm, the drafter's LM head and sequential head as the full path
uses them, and a confidence head of its own. Proposals of two or more positions never read it. It is trained with
every other weight frozen (`DrafterTrainConfig.exit_only`), so the full block computes exactly what it did; a drafter
grown with it (`train/surgery.py` `with_exit`) starts as a copy of the backbone layer it replaces, the final norm
and the confidence head.
"""

from __future__ import annotations

from torch import nn

from dspark.drafters.backbone import layer_config
from dspark.drafters.base import DrafterConfig
from dspark.drafters.heads import ConfidenceHead
from dspark.models.decoder import DecoderLayer
from dspark.models.layers import RMSNorm


class Exit(nn.Module):
    """The exit's decoder layer (run by the backbone, `Backbone.run_paged` / `run_dense` with `then`), its final
    norm and its confidence head (None where the drafter has none)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.layer = DecoderLayer(layer_config(cfg.replace(intermediate_size=cfg.exit_mlp), 1))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        rank = cfg.rank if cfg.confidence_markov else 0
        self.conf = ConfidenceHead(cfg.hidden_size, rank) if cfg.confidence else None

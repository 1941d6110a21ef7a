"""The KV-injected parallel backbone shared by DSpark and DFlash (`docs/architecture.md`, The DSpark drafter).

Context features `H_ctx = RMSNorm(W_c [H(l1); ...; H(lm)])` are never run through the
layers: each layer projects them to keys/values (`context_kv`) that the block's queries
attend to, together with the block's own keys/values. The block (anchor-first:
`[x0, mask, ..., mask]`, gamma slots) is bidirectional within itself and sees only context
before the anchor. With `context_residual` every slot's residual stream also starts from `W_r H_ctx` of the
position before the anchor (zero at init, so an older drafter grows into it unchanged). Two attention paths share
every weight:
- serving: context K/V live in a paged cache per request (written by `write_context`), the
  block is a flat batch attending through `paged_attention` with a non-causal mask;
- training: dense tensors with an explicit mask (`forward_dense`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dspark.config import ModelConfig
from dspark.drafters.base import DrafterConfig
from dspark.drafters.slots import SlotMLP
from dspark.models.attention import AttentionMetadata, write_kv
from dspark.models.decoder import DecoderLayer, KVLayer
from dspark.models.layers import RMSNorm, Rotary, apply_rope


def layer_config(cfg: DrafterConfig, num_layers: int | None = None) -> ModelConfig:
    """The drafter's layers are target-family (Qwen3 or Llama) decoder layers of the same width."""
    return ModelConfig(
        model_type=cfg.layer_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=num_layers or cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling,
    )


class Backbone(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        lc = layer_config(cfg)
        self.fc = nn.Linear(len(cfg.taps) * cfg.hidden_size, cfg.hidden_size, bias=False)  # W_c
        self.ctx_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False) if cfg.context_residual else None
        if self.residual is not None:
            nn.init.zeros_(self.residual.weight)
        self.layers = nn.ModuleList(DecoderLayer(lc) for _ in range(cfg.num_layers))
        self.slot_mlps = nn.ModuleList(SlotMLP(cfg.slots, cfg.hidden_size, cfg.slot_mlp) for _ in self.layers) \
            if cfg.slot_mlp else None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """Tapped target hidden states [..., m*d] -> H_ctx [..., d]."""
        return self.ctx_norm(self.fc(taps))

    def block_start(self, x: torch.Tensor, h_last: torch.Tensor | None) -> torch.Tensor:
        """Block embeddings x [..., g, d] plus W_r H_ctx [..., d] of the position before each anchor."""
        if self.residual is None:
            return x
        return x + self.residual(h_last)[..., None, :]

    def context_kv(self, layer: DecoderLayer, h_ctx: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """H_ctx [..., d] -> K [..., Hkv, D] (k-norm, RoPE at the context positions), V."""
        attn = layer.self_attn
        lead = h_ctx.shape[:-1]
        k, v = attn.project(h_ctx, first=1)
        k, v = k.view(*lead, attn.kv_heads, attn.head_dim), v.view(*lead, attn.kv_heads, attn.head_dim)
        if attn.qk_norm:
            k = attn.k_norm(k)
        return apply_rope(k, cos, sin), v

    # ---- serving path ------------------------------------------------------------------
    def write_context(self, h_ctx: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      cache: list[KVLayer], then: DecoderLayer | None = None) -> None:
        """Project H_ctx [N, d] at positions [N] into every layer's cache slots [N] (and `then`'s, the last)."""
        cos, sin = self.rotary.cos_sin(positions, h_ctx.dtype)
        layers = [*self.layers, then] if then is not None else self.layers
        for layer, (kc, vc) in zip(layers, cache, strict=True):
            write_kv(kc, vc, slots, *self.context_kv(layer, h_ctx, cos, sin))

    def after_layer(self, i: int, x: torch.Tensor, slots: int) -> torch.Tensor:
        """Layer i's output x [..., n*slots, d] (blocks of `slots` slots in a row) with each slot's own MLP added."""
        if self.slot_mlps is None:
            return x
        return self.slot_mlps[i](x.view(*x.shape[:-2], -1, slots, x.shape[-1])).view(x.shape)

    def forward_paged(self, x: torch.Tensor, meta: AttentionMetadata, cache: list[KVLayer],
                      slots: int) -> torch.Tensor:
        """Block embeddings x [N, d] (N = requests x slots, each request's slots in a row) -> final-normed
        hidden [N, d]."""
        return self.norm(self.run_paged(x, meta, cache, slots, len(self.layers)))

    def run_paged(self, x: torch.Tensor, meta: AttentionMetadata, cache: list[KVLayer], slots: int,
                  layers: int, then: DecoderLayer | None = None) -> torch.Tensor:
        """`forward_paged` through the first `layers` layers only, then the layer `then` (an exit's own, its
        context K/V in the cache's last layer), before any final norm."""
        cos, sin = self.rotary.cos_sin(meta.positions, x.dtype)
        for i, (layer, kv) in enumerate(zip(self.layers[:layers], cache[:layers], strict=True)):
            x = self.after_layer(i, layer(x, cos, sin, meta, kv), slots)
        return x if then is None else then(x, cos, sin, meta, cache[-1])

    # ---- training path -----------------------------------------------------------------
    def forward_dense(self, x: torch.Tensor, block_pos: torch.Tensor, h_ctx: torch.Tensor,
                      mask: torch.Tensor, slots: int) -> torch.Tensor:
        """x [B, Q, d] block embeddings (Q = blocks x slots) at positions block_pos [B, Q]; h_ctx [B, T, d];
        mask [B, 1, Q, T+Q] (True = attend) -> final-normed hidden [B, Q, d]."""
        return self.norm(self.run_dense(x, block_pos, h_ctx, mask, slots, len(self.layers)))

    def run_dense(self, x: torch.Tensor, block_pos: torch.Tensor, h_ctx: torch.Tensor, mask: torch.Tensor,
                  slots: int, layers: int, then: DecoderLayer | None = None) -> torch.Tensor:
        """`forward_dense` through the first `layers` layers only, then the layer `then` (an exit's own), before
        any final norm."""
        ctx_pos = torch.arange(h_ctx.shape[1], device=x.device)
        ccos, csin = self.rotary.cos_sin(ctx_pos, x.dtype)
        bcos, bsin = self.rotary.cos_sin(block_pos, x.dtype)

        def through(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
            return layer_with_prefix(layer, x, bcos, bsin, *self.context_kv(layer, h_ctx, ccos, csin), mask)

        for i, layer in enumerate(self.layers[:layers]):
            x = self.after_layer(i, through(layer, x), slots)
        return x if then is None else through(then, x)


def layer_with_prefix(layer: DecoderLayer, x: torch.Tensor, cos, sin, prefix_k: torch.Tensor,
                      prefix_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One decoder layer whose queries x [B, Q, d] attend to [prefix K/V [B, P, Hkv, D] ; own K/V]
    under mask [B, 1, Q, P+Q] (True = attend). The dense training form of KV injection."""
    attn = layer.self_attn
    q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)
    keys, values = torch.cat([prefix_k, k], dim=1), torch.cat([prefix_v, v], dim=1)
    rep = attn.heads // attn.kv_heads
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2).repeat_interleave(rep, 1),
        values.transpose(1, 2).repeat_interleave(rep, 1), attn_mask=mask,
    ).transpose(1, 2)
    x = x + attn.output(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))

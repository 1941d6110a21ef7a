"""The target runtime: Qwen3 and Llama decoder families in one module.

Two entry points share every weight:
- `forward(input_ids [N], meta, kv_caches, logits_indices, taps)`: the serving path, a flat
  batch of many requests' new tokens reading/writing the paged KV cache, returning logits
  only where asked and the hidden states of the tapped layers (for the drafters);
- `forward_dense(input_ids [B, T], taps)`: a plain causal pass for training and for the
  drafters' online target features.

Parameter names follow Hugging Face (`model.layers.0.self_attn.q_proj.weight`, ...), so a
checkpoint loads with a plain `load_state_dict`. Qwen3 differs from Llama only by the
per-head q/k RMSNorm (`ModelConfig.qk_norm`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dspark.config import ModelConfig
from dspark.models.attention import AttentionMetadata, causal_attention, paged_attention
from dspark.models.fused import Fused, outputs, refresh, stamp
from dspark.models.layers import RMSNorm, Rotary, SwiGLU, apply_rope, normalized

KVLayer = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [Hkv, num_slots, D]


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [M, V] float32, one row per requested logits index
    taps: torch.Tensor | None  # [N, len(taps) * d] hidden states of the tapped layers


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(d, self.heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.heads * hd, d, bias=bias)
        self.qk_norm = cfg.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.fused: Fused | None = None  # q, k and v as one product (`fuse_projections`)
        self.fused_out: Fused | None = None  # o_proj's product
        self.stacked_qk: tuple[tuple, torch.Tensor] | None = None  # (`stamp` of q/k-norm weights, weight) of `qk_weight`

    def fuse_projections(self) -> None:
        self.fused = refresh(self.fused, self.q_proj, self.k_proj, self.v_proj)
        self.fused_out = refresh(self.fused_out, self.o_proj)

    def output(self, heads: torch.Tensor) -> torch.Tensor:
        """o_proj over the heads flattened: [..., H, D] -> [..., d]."""
        return outputs(self.fused_out, (self.o_proj,), heads.flatten(-2))[0]

    def project(self, x: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, ...]:
        """(q, k, v) projections of x, or (k, v) from first = 1; one product where fused."""
        return outputs(self.fused, (self.q_proj, self.k_proj, self.v_proj), x, first)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., d] -> q [..., H, D], k/v [..., Hkv, D] with q/k-norm and RoPE applied."""
        lead, h, hkv = x.shape[:-1], self.heads, self.kv_heads
        if self.fused is not None and self.fused.usable():
            # one product's q, k and v heads side by side: q and k are normed and rotated as one tensor
            heads = self.fused.joined(x).view(*lead, h + 2 * hkv, self.head_dim)
            qk = apply_rope(self.norm_qk(heads[..., : h + hkv, :]), cos, sin)
            return qk[..., :h, :], qk[..., h:, :], heads[..., h + hkv :, :]
        q, k, v = (t.view(*lead, -1, self.head_dim) for t in self.project(x))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """q/k-norm of q and k heads side by side [..., H + Hkv, D], each head by its own weight (Qwen3;
        Llama has none). Per head what q_norm and k_norm give: a kernel call each saved in every layer."""
        if not self.qk_norm:
            return qk
        return self.qk_weight() * normalized(qk, self.q_norm.eps)

    def qk_weight(self) -> torch.Tensor:
        """[H + Hkv, D]: q_norm's weight for each q head, then k_norm's for each k head; stacked again only
        after either changed (their version counters and storage), not in every layer of every step."""
        q, k = self.q_norm.weight, self.k_norm.weight
        key = stamp(q, k)
        if self.stacked_qk is None or self.stacked_qk[0] != key:
            self.stacked_qk = (key, torch.cat([q.expand(self.heads, -1), k.expand(self.kv_heads, -1)]).detach())
        return self.stacked_qk[1]

    def forward(self, x, cos, sin, meta: AttentionMetadata | None, kv: KVLayer | None) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        if meta is None:
            out = causal_attention(q, k, v)
        else:
            assert kv is not None, "the flat path needs a KV cache"
            out = paged_attention(q, k, v, kv[0], kv[1], meta)
        return self.output(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, meta=None, kv=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)


class CausalLM(nn.Module):
    """A Qwen3/Llama causal language model (the target)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.fused_head: Fused | None = None  # lm_head's product (`fuse_projections`)

    def fuse_projections(self) -> None:
        """The LM head's product (the layers fuse their own: `models/fused.py`)."""
        self.fused_head = refresh(self.fused_head, self.lm_head)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def _run_layers(self, x, positions, meta, kv_caches, taps: Sequence[int]):
        cos, sin = self.model.rotary.cos_sin(positions, x.dtype)
        tapped = [x] if -1 in taps else []  # tap -1: the embeddings (DeepSpec's target_layer_ids allow it)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, meta, kv_caches[i] if kv_caches is not None else None)
            if i in taps:
                tapped.append(x)
        return x, (torch.cat(tapped, dim=-1) if taps else None)

    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        meta: AttentionMetadata,
        kv_caches: Sequence[KVLayer],
        logits_indices: torch.Tensor | None = None,  # [M] flat rows that need logits
        taps: Sequence[int] = (),
    ) -> ForwardOutput:
        x = self.model.embed_tokens(input_ids)  # [N, d]
        x, tapped = self._run_layers(x, meta.positions, meta, kv_caches, taps)
        if logits_indices is not None:
            x = x[logits_indices]
        return ForwardOutput(logits=self.logits(x), taps=tapped)

    def forward_dense(
        self, input_ids: torch.Tensor, taps: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [B, T] -> final-norm hidden [B, T, d], tapped hidden [B, T, m*d]."""
        x = self.model.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x, tapped = self._run_layers(x, positions, None, None, taps)
        return self.model.norm(x), tapped

    def logits(self, hidden: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """LM head in float32 (sampling and verification compare probabilities exactly)."""
        h = hidden if normed else self.model.norm(hidden)
        return outputs(self.fused_head, (self.lm_head,), h)[0].float()

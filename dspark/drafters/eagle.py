"""EAGLE-3 as published (SafeAILab, SpecForge, vLLM's speculators `eagle3`): one decoder layer
whose attention reads the concatenation [norm(emb(x_i)); norm(g_{i-1})] (2d wide) with g as the
residual stream, drafting autoregressively.

g is the fused target feature `fc([H(l1); H(l2); H(l3)])` for committed tokens, and the layer's
own (pre-norm) output while drafting. Entry i pairs g_{i-1} with token x_i; the first token of a
sequence has no entry, so a request with n committed tokens caches n-1 entries (entry i in slot
and RoPE position i-1: attention sees only relative positions). The LM head is the checkpoint's
own, over its draft vocabulary (`config.draft_vocab`, from d2t). Serving only: dspark trains its
own `eagle3` layout (`drafters/shifted.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dspark.device import upload
from dspark.drafters.backbone import layer_config
from dspark.drafters.base import ContextRow, DraftBlock, DrafterConfig, ProposeInput, depth_of, widened
from dspark.drafters.neural import NeuralDrafter
from dspark.models.attention import AttentionMetadata, write_kv
from dspark.models.decoder import Attention
from dspark.models.layers import RMSNorm, Rotary, SwiGLU
from dspark.sampling import SamplingRows


class SplitLayer(nn.Module):
    """EAGLE-3's first layer: q/k/v read [input_layernorm(emb); hidden_norm(g)], the residual is g."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        lc = layer_config(cfg, 1)
        d = cfg.hidden_size
        self.self_attn = Attention(lc)
        for name, heads in (("q_proj", lc.num_attention_heads), ("k_proj", lc.num_key_value_heads),
                            ("v_proj", lc.num_key_value_heads)):
            setattr(self.self_attn, name, nn.Linear(2 * d, heads * lc.head_dim, bias=False))
        self.mlp = SwiGLU(d, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm_before_residual = cfg.norm_before_residual

    def inputs(self, emb: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (attention input [..., 2d], residual [..., d])."""
        h = self.hidden_norm(g)
        return torch.cat([self.input_layernorm(emb), h], dim=-1), h if self.norm_before_residual else g

    def forward(self, emb, g, cos, sin, meta, kv) -> torch.Tensor:
        x, residual = self.inputs(emb, g)
        x = residual + self.self_attn(x, cos, sin, meta, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Drafter(NeuralDrafter):
    def __init__(self, config: DrafterConfig) -> None:
        if config.num_layers != 1:
            raise ValueError("EAGLE-3 as published has one decoder layer (num_hidden_layers: 1)")
        if not config.own_lm_head:
            raise ValueError("EAGLE-3 as published drafts with its own LM head (own_lm_head)")
        super().__init__(config)
        d = config.hidden_size
        self.fc = nn.Linear(len(config.taps) * d, d, bias=False)
        self.layer = SplitLayer(config)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling_dict)
        # per request: how many tokens are committed, and g of the last one [d] (the only one read again)
        self.last: dict[str, tuple[int, torch.Tensor]] = {}

    # ---- context: entry i = (g_{i-1}, x_i) for i >= 1, in slot i-1 ------------------------------
    @torch.inference_mode()
    def extend(self, rows: Sequence[ContextRow]) -> None:
        gs, embs, slots, positions = [], [], [], []
        for r in (r for r in rows if len(r.token_ids)):
            done, prev = self.last.get(r.seq_id, (0, None))
            if done != r.start:
                raise RuntimeError(f"drafter context of {r.seq_id} has {done} tokens, got start {r.start}")
            new = self.fc(r.features.to(self.target.dtype))  # g of the new tokens
            every = new if prev is None else torch.cat([prev[None], new])  # g from token r.start - 1 (or 0) on
            offset = r.start if prev is None else r.start - 1
            self.last[r.seq_id] = (r.start + len(r.token_ids), new[-1])
            first = max(r.start, 1)  # the sequence's first token has no entry
            count = r.start + len(r.token_ids) - first
            if count <= 0:
                continue
            self.pool.append(r.seq_id, count)
            gs.append(every[first - 1 - offset: first - 1 - offset + count])
            embs.append(upload(list(r.token_ids[first - r.start:]), self.target.device))
            slots.extend(self.pool.slots(r.seq_id, first - 1, count))
            positions.extend(range(first - 1, first - 1 + count))
        if not gs:
            return
        dev = self.target.device
        pos = upload(positions, dev)
        cos, sin = self.rotary.cos_sin(pos, self.target.dtype)
        x, _ = self.layer.inputs(self.embed(torch.cat(embs)), torch.cat(gs))
        _, k, v = self.layer.self_attn.qkv(x, cos, sin)
        write_kv(*self.cache.layers[0], upload(slots, dev), k, v)

    def free(self, seq_id: str) -> None:
        super().free(seq_id)
        self.last.pop(seq_id, None)

    def cache_bytes_in_use(self) -> int:
        """The paged context entries plus the last feature kept per request."""
        return super().cache_bytes_in_use() + sum(g.numel() * g.element_size() for _, g in self.last.values())

    # ---- drafting -----------------------------------------------------------------------------
    @property
    def cuts_exactly(self) -> bool:
        return True  # autoregressive: position k never reads a later one

    @torch.inference_mode()
    def propose(self, inputs: Sequence[ProposeInput], rows: SamplingRows, depth: int | None = None) -> DraftBlock:
        self.select_vocab(rows)
        dev = self.target.device
        for i in inputs:
            if i.context_len < 1 or self.pool.length(i.seq_id) != i.context_len - 1:
                raise RuntimeError(f"drafter context of {i.seq_id} is out of step with the target")
        if any(self.last[i.seq_id][0] != i.context_len for i in inputs):
            raise RuntimeError("drafter features are out of step with the target")
        g = torch.stack([self.last[i.seq_id][1] for i in inputs])
        prev = upload([i.anchor for i in inputs], dev)
        gens, tokens, probs = [i.generator for i in inputs], [], []
        try:
            for k in range(depth_of(self, depth)):
                for i in inputs:
                    self.pool.append(i.seq_id, 1)
                meta = AttentionMetadata.build([1] * len(inputs), [i.context_len + k for i in inputs],
                                               [self.pool.block_table(i.seq_id) for i in inputs], self.pool.block_size, dev,
                                               invariant=False)
                cos, sin = self.rotary.cos_sin(meta.positions, g.dtype)
                g = self.layer(self.embed(prev), g, cos, sin, meta, self.cache.layers[0])  # [R, d]
                prev, p = self.draw(self.lm_head(self.norm(g)), rows, gens)
                tokens.append(prev)
                probs.append(p)
        finally:
            for i in inputs:
                self.pool.truncate(i.seq_id, i.context_len - 1)
        block = torch.stack(tokens, 1)
        return widened(DraftBlock(block, self.block_probs(probs), None), self.gamma)

    def forward(self, *args, **kwargs):
        raise RuntimeError("EAGLE-3 checkpoints in the published layout serve only; train dspark's eagle3 drafter")

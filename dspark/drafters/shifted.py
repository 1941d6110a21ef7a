"""EAGLE-3 and MTP-1 baselines: one decoder layer that drafts autoregressively.

Entry i of the drafter's sequence is `z_i = W_in [norm(f_{i-1}); norm(emb(x_i))]`, where
f is the fused target feature (EAGLE-3: W_fuse over low/mid/high tapped layers; MTP: the
last layer's hidden state) for committed tokens, and the layer's own output while
drafting. With a single layer, an entry's K/V depend only on z_i, so committed context
is cached without running attention. Drafting step k attends to the context and to the
steps before it. Training uses training-time test: steps 2..gamma consume the layer's
own outputs (`train_forward`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dspark.device import upload
from dspark.drafters.backbone import layer_config, layer_with_prefix
from dspark.drafters.base import ContextRow, DraftBlock, DrafterConfig, ProposeInput, depth_of, widened
from dspark.drafters.neural import NeuralDrafter
from dspark.models.attention import AttentionMetadata, write_kv
from dspark.models.decoder import DecoderLayer
from dspark.models.layers import RMSNorm, Rotary
from dspark.sampling import SamplingRows


class ShiftedDrafter(NeuralDrafter):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        m = len(config.taps)
        self.fuse = nn.Linear(m * d, d, bias=False) if m > 1 else nn.Identity()
        self.feat_norm = RMSNorm(d, config.rms_norm_eps)
        self.emb_norm = RMSNorm(d, config.rms_norm_eps)
        self.inp = nn.Linear(2 * d, d, bias=False)
        self.layer = DecoderLayer(layer_config(config, 1))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling_dict)
        # per request: the fused feature f of its last committed token [d], the only one ever read
        # again (the next context entry's f_{i-1}, and the first draft step's input)
        self.last: dict[str, torch.Tensor] = {}

    def entry(self, feat: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """z = W_in [norm(f_{i-1}); norm(emb(x_i))]; feat and tokens aligned on the last dims."""
        return self.inp(torch.cat([self.feat_norm(feat), self.emb_norm(self.embed(tokens))], dim=-1))

    # ---- serving ------------------------------------------------------------------------
    def write_context(self, rows: Sequence[ContextRow]) -> None:
        prev_feats, toks = [], []
        for r in rows:
            fused = self.fuse(r.features.to(self.target.dtype))  # [n, d]
            before = self.last.get(r.seq_id)
            first = before[None] if before is not None else torch.zeros_like(fused[:1])
            prev_feats.append(torch.cat([first, fused[:-1]]))
            self.last[r.seq_id] = fused[-1].clone()  # a copy: a view would keep all n rows alive
            toks.extend(r.token_ids)
        z = self.entry(torch.cat(prev_feats), upload(toks, self.target.device))
        slots, positions = self.slots_and_positions(rows)
        cos, sin = self.rotary.cos_sin(positions, z.dtype)
        _, k, v = self.layer.self_attn.qkv(self.layer.input_layernorm(z), cos, sin)
        write_kv(*self.cache.layers[0], slots, k, v)

    def free(self, seq_id: str) -> None:
        super().free(seq_id)
        self.last.pop(seq_id, None)

    def cache_bytes_in_use(self) -> int:
        """The paged context entries plus the last feature kept per request."""
        return super().cache_bytes_in_use() + sum(f.numel() * f.element_size() for f in self.last.values())

    @property
    def cuts_exactly(self) -> bool:
        return True  # autoregressive: position k never reads a later one

    @torch.inference_mode()
    def propose(self, inputs: Sequence[ProposeInput], rows: SamplingRows, depth: int | None = None) -> DraftBlock:
        self.select_vocab(rows)
        dev, d = self.target.device, self.config.hidden_size
        feat = torch.stack([self.last[i.seq_id] if i.context_len else torch.zeros(d, device=dev, dtype=self.target.dtype)
                            for i in inputs])
        prev = upload([i.anchor for i in inputs], dev)
        gens = [i.generator for i in inputs]
        tokens, probs = [], []
        try:
            for k in range(depth_of(self, depth)):
                for i in inputs:
                    self.pool.append(i.seq_id, 1)
                meta = AttentionMetadata.build([1] * len(inputs), [i.context_len + k + 1 for i in inputs],
                                               [self.pool.block_table(i.seq_id) for i in inputs], self.pool.block_size, dev,
                                               invariant=False)
                cos, sin = self.rotary.cos_sin(meta.positions, feat.dtype)
                out = self.layer(self.entry(feat, prev), cos, sin, meta, self.cache.layers[0])  # [R, d]
                prev, p = self.draw(self.lm_head(self.norm(out)), rows, gens)
                feat = out
                tokens.append(prev)
                probs.append(p)
        finally:
            for i in inputs:
                self.pool.truncate(i.seq_id, i.context_len)
        block = torch.stack(tokens, 1)
        return widened(DraftBlock(block, self.block_probs(probs), None), self.gamma)

    # ---- training (training-time test) ------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.train_forward(*args, **kwargs)

    def train_forward(self, taps: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor, **_: object):
        """taps [B, T, m*d], tokens [B, T], anchors [B, A] -> logits [B, A, g, V], None."""
        self.check_trainable()
        b, t = tokens.shape
        dev = tokens.device
        fused = self.fuse(taps)
        prev = torch.cat([torch.zeros_like(fused[:, :1]), fused[:, :-1]], dim=1)
        z = self.entry(prev, tokens)  # [B, T, d]
        pos = torch.arange(t, device=dev)
        cos, sin = self.rotary.cos_sin(pos, z.dtype)
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()[None, None]
        empty = z.new_zeros(b, 0, self.layer.self_attn.kv_heads, self.layer.self_attn.head_dim)
        seq_out = layer_with_prefix(self.layer, z, cos, sin, empty, empty, causal.expand(b, 1, t, t))
        _, seq_k, seq_v = self.layer.self_attn.qkv(self.layer.input_layernorm(z), cos, sin)
        out = seq_out.gather(1, anchors[..., None].expand(-1, -1, seq_out.shape[-1]))  # step 1: [B, A, d]
        outs, chain_k, chain_v = [out], [], []
        for k in range(1, self.gamma):
            step_pos = anchors + k  # [B, A]
            x_prev = tokens.gather(1, step_pos.clamp(max=t - 1))  # teacher token at the step's position
            zk = self.entry(out, x_prev)
            ccos, csin = self.rotary.cos_sin(step_pos, zk.dtype)
            prefix_k = torch.cat([seq_k, *chain_k], dim=1) if chain_k else seq_k
            prefix_v = torch.cat([seq_v, *chain_v], dim=1) if chain_v else seq_v
            mask = shifted_mask(anchors, t, k)
            out = layer_with_prefix(self.layer, zk, ccos, csin, prefix_k, prefix_v, mask)
            _, kk, vv = self.layer.self_attn.qkv(self.layer.input_layernorm(zk), ccos, csin)
            chain_k.append(kk)
            chain_v.append(vv)
            outs.append(out)
        hidden = torch.stack(outs, dim=2)  # [B, A, g, d]
        return self.lm_head(self.norm(hidden)), None


def shifted_mask(anchors: torch.Tensor, seq_len: int, step: int) -> torch.Tensor:
    """[B, 1, A, T + A*(step-1) + A]: step `step` of anchor a sees sequence entries <= anchor,
    its own earlier chain entries and itself."""
    b, a = anchors.shape
    dev = anchors.device
    seq = torch.arange(seq_len, device=dev)[None, None, :] <= anchors[:, :, None]  # [B, A, T]
    same = torch.eye(a, dtype=torch.bool, device=dev)[None].expand(b, -1, -1)  # [B, A, A]
    chain = [same] * (step - 1)
    return torch.cat([seq, *chain, same], dim=-1)[:, None]

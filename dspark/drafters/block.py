"""The DSpark drafter (and DFlash, the same backbone without heads).

One parallel backbone pass over the anchor-first block `[x0, mask, ..., mask]` gives base
logits U_1..U_gamma; the sequential head then samples left to right from
softmax((U_k + B_k) / T) with top-p/top-k, and the confidence head scores each position
from [h_k; W1[x_{k-1}]] (`docs/architecture.md`, The DSpark drafter). `train_forward` is the teacher-forced version
used by training; `propose` is what the engine calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.device import upload
from dspark.drafters.backbone import Backbone
from dspark.drafters.base import ContextRow, DraftBlock, DrafterConfig, ProposeInput, depth_of, widened
from dspark.drafters.exit import Exit
from dspark.drafters.heads import ConfidenceHead, SequentialHead, calibrated
from dspark.drafters.neural import NeuralDrafter
from dspark.drafters.tables import greedy_walk
from dspark.models.attention import AttentionMetadata
from dspark.models.layers import SwiGLU
from dspark.sampling import SamplingRows


class BlockDrafter(NeuralDrafter):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        self.cache_layers = config.num_layers + (1 if config.exit_mlp else 0)  # the exit's layer last
        self.backbone = Backbone(config)
        self.head = SequentialHead(config.head, config.vocab_size, config.rank, config.hidden_size) \
            if config.head != "none" else None
        if self.head is not None and config.head == "mlp":
            self.head.project = self.lm_head  # its correction is read through the same head as the base logits
        self.conf = ConfidenceHead(config.hidden_size, config.rank if config.confidence_markov else 0) \
            if config.confidence else None
        self.anchor = SwiGLU(config.hidden_size, config.anchor_mlp) if config.anchor_mlp else None
        if self.anchor is not None:  # adds nothing until training moves it
            torch.nn.init.zeros_(self.anchor.down_proj.weight)
        self.exit = Exit(config) if config.exit_mlp else None
        self.features: torch.Tensor | None = None  # [slots, d] H_ctx per cache slot (context_residual, after bind)

    @property
    def has_confidence(self) -> bool:
        return self.conf is not None

    def anchored(self, hidden: torch.Tensor) -> torch.Tensor:
        """Block hidden [..., g, d] with the anchor slot's own MLP added to slot 0 (`anchor_mlp`)."""
        if self.anchor is None:
            return hidden
        first = hidden[..., :1, :]
        return torch.cat([first + self.anchor(first), hidden[..., 1:, :]], dim=-2)

    # ---- serving ----------------------------------------------------------------------
    def bind(self, target, num_blocks: int, block_size: int) -> None:
        super().bind(target, num_blocks, block_size)
        # with context_residual, H_ctx itself is kept per cache slot: propose reads the one before each anchor
        self.features = torch.zeros(num_blocks * block_size, self.config.hidden_size, device=target.device,
                                    dtype=target.dtype) if self.backbone.residual is not None else None

    def write_context(self, rows: Sequence[ContextRow]) -> None:
        feats = torch.cat([r.features for r in rows]).to(self.target.dtype)  # [N, m*d]
        slots, positions = self.slots_and_positions(rows)
        h_ctx = self.backbone.context(feats)
        self.backbone.write_context(h_ctx, positions, slots, self.cache.layers,
                                    None if self.exit is None else self.exit.layer)
        if self.features is not None:
            self.features[slots] = h_ctx

    def last_context(self, inputs: Sequence[ProposeInput]) -> torch.Tensor | None:
        """H_ctx [R, d] of the position before each anchor (zero with no context), when the backbone reads it."""
        if self.features is None:
            return None
        slots = [self.pool.slots(i.seq_id, i.context_len - 1, 1)[0] if i.context_len else 0 for i in inputs]
        keep = upload([float(i.context_len > 0) for i in inputs], self.target.device, self.features.dtype)
        return self.features[upload(slots, self.target.device)] * keep[:, None]

    def block_inputs(self, anchors: torch.Tensor, slots: int | None = None) -> torch.Tensor:
        """anchors [...] -> block token ids [..., slots] (default gamma): the anchor, then masks."""
        slots = slots or self.gamma
        masks = torch.full((*anchors.shape, slots - 1), self.config.mask_token_id, device=anchors.device)
        return torch.cat([anchors[..., None], masks], dim=-1)

    def fed_inputs(self, prev: torch.Tensor, fed: torch.Tensor | None) -> torch.Tensor:
        """Block token ids [..., g] for prev [..., g] (x_0..x_{g-1}): the anchor and masks, or where fed [...]
        holds, the tokens themselves."""
        ids = self.block_inputs(prev[..., 0])
        if fed is None:
            return ids
        if not self.config.causal_block:
            raise ValueError("a fed block needs a causal block: a bidirectional slot would read the tokens it predicts")
        return torch.where(fed[..., None], prev, ids)

    @property
    def cuts_exactly(self) -> bool:
        return self.config.causal_block

    @property
    def exits(self) -> bool:
        return bool(self.config.exit_mlp)

    @torch.inference_mode()
    def propose(self, inputs: Sequence[ProposeInput], rows: SamplingRows, depth: int | None = None) -> DraftBlock:
        depth = depth_of(self, depth)
        self.select_vocab(rows)
        first = 0 if self.config.anchor_slot else 1  # DFlash: the anchor's slot predicts nothing
        # a bidirectional block runs whole and its first gamma proposals are kept; a causal one only as deep as asked
        g, dev = first + depth if self.config.causal_block else self.config.slots, self.target.device
        for inp in inputs:
            if self.pool.length(inp.seq_id) != inp.context_len:
                raise RuntimeError(f"drafter context of {inp.seq_id} is out of step with the target")
            self.pool.append(inp.seq_id, g)  # temporary slots for the block's own K/V
        try:
            meta = AttentionMetadata.build(
                [g] * len(inputs), [i.context_len + g for i in inputs],
                [self.pool.block_table(i.seq_id) for i in inputs], self.pool.block_size, dev,
                causal=self.config.causal_block, invariant=False,
            )
            anchors = upload([i.anchor for i in inputs], dev)
            last = self.last_context(inputs)
            exits = self.exit is not None and depth == 1  # one position: read it at the exit (g is 1 here)
            hidden = (self.exit_hidden if exits else self.block_hidden)(self.block_inputs(anchors, g), last, meta)
            generators, anchor_ids = [i.generator for i in inputs], [i.anchor for i in inputs]
            block = self.sample_block(hidden[:, first:first + depth], anchors, rows, generators, anchor_ids, exits)
            for _ in range(self.config.refine if rows.all_greedy and depth > 1 else 0):
                fed = torch.cat([anchors[:, None], block.tokens[:, : depth - 1]], 1)
                block, settled = refined(block, self.sample_block(self.block_hidden(fed, last, meta), anchors, rows,
                                                                  generators, anchor_ids))
                if settled:  # every request's pass drafted what it read: another would draft the same again
                    break
        finally:
            for inp in inputs:
                self.pool.truncate(inp.seq_id, inp.context_len)
        return widened(block, self.gamma)

    def block_hidden(self, ids: torch.Tensor, last: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [R, g, d] of one pass over the blocks' slot ids [R, g] (their K/V written into the
        temporary slots, over what an earlier pass wrote there)."""
        x = self.backbone.block_start(self.embed(ids), last).flatten(0, 1)  # [R*g, d]
        hidden = self.backbone.forward_paged(x, meta, self.cache.layers, ids.shape[-1])
        return self.anchored(hidden.view(*ids.shape, -1))

    def exit_hidden(self, ids: torch.Tensor, last: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """The exit's hidden states [R, 1, d] of the anchor slots ids [R, 1]: its layer after `exit_layer` backbone
        layers, normed."""
        x = self.backbone.block_start(self.embed(ids), last).flatten(0, 1)
        x = self.backbone.run_paged(x, meta, self.cache.layers, 1, self.config.exit_layer, self.exit.layer)
        return self.exit.norm(x).view(*ids.shape, -1)

    def restrict_heads(self, ids: torch.Tensor | None, rows: torch.Tensor | None) -> None:
        if self.head is not None:
            self.head.restrict(ids, rows)

    def narrow_heads(self, narrow: bool) -> None:
        if self.head is not None:
            self.head.narrow = narrow

    def sample_block(self, hidden, anchors, rows: SamplingRows, generators,
                     anchor_ids: Sequence[int] = (), exits: bool = False) -> DraftBlock:
        """Left-to-right sampling of the block's positions from hidden [R, depth, d]; anchor_ids: the
        anchors on the host, to read the first bias from the markov table where it holds them; exits: hidden is
        the exit's (scored by its own confidence head, with the first position's STS temperatures)."""
        base = self.lm_head(hidden)  # [R, depth, V] float32 (or [R, depth, N] over a draft vocabulary)
        table = None if self.head is None else self.head.active_table
        mix = None if table is None else self.head.active_mix  # an mlp head's correction, from tables too
        start = None if mix is None else mix.start(hidden)
        # the table row of each anchor, when the table holds every one: the first bias is then a row too
        first = self.head.table_rows(anchor_ids) if table is not None and anchor_ids else None
        if table is not None and rows.all_greedy:
            picks, probs = self.greedy_block(base, hidden, anchors, (table, mix, start), first), [None]
        else:
            picks, probs = self.walk(base, hidden, anchors, (table, mix, start), first, rows, generators)
        block = self.token_ids(picks)
        # the confidence of x_k reads [h_k; W1[x_{k-1}]]: known once the block is drawn, scored in one pass
        raw, conf = None, self.exit.conf if exits else self.conf
        if conf is not None:
            embs = self.head.w1(torch.cat([anchors[:, None], block[:, :-1]], 1)) \
                if self.config.confidence_markov and self.head is not None else None
            raw = conf(hidden, embs)
        cfg = self.config
        confidence = None if raw is None else calibrated(raw, rows.greedy, cfg.sts_temperatures, cfg.sts_greedy)
        return DraftBlock(block, self.block_probs(probs), confidence, confidence_logits=raw)

    def greedy_block(self, base, hidden, anchors, tables, first: torch.Tensor | None) -> torch.Tensor:
        """A greedy block along the tables -> positions [R, depth]. first: each anchor's table row; None when
        an anchor is outside the draft vocabulary, and the head's own step then gives the first position's bias."""
        table, mix, start = tables
        if first is not None:
            return greedy_walk(base, table, first, mix, start)
        bias, _, _ = self.head.step(hidden[:, 0], anchors, None)
        first = (base[:, 0] + bias.float()).argmax(-1)
        rest = greedy_walk(base[:, 1:], table, first, mix, None if start is None else start[:, 1:])
        return torch.cat([first[:, None], rest], 1)

    def walk(self, base, hidden, anchors, tables, index, rows: SamplingRows, generators):
        """Draw the block left to right -> (positions [R, depth], each position's distribution or None).
        tables: the markov table, the mlp head's `Mix` and the block's start for it (each None where absent);
        index: each anchor's table row (None: the head's product gives the first bias)."""
        table, mix, start = tables
        prev, state = anchors, None
        picks, probs = [], []
        for k in range(hidden.shape[1]):
            logits = base[:, k]
            if table is not None and index is not None:  # x_{k-1} is in the draft vocabulary: its rows of the tables
                logits = logits + table.index_select(0, index)
                if mix is not None:
                    logits = logits + mix.bias(start[:, k], index)
            elif self.head is not None:
                bias, _, state = self.head.step(hidden[:, k], prev, state)
                logits = logits + bias.float()
            index, p = self.pick(logits, rows, generators)
            if self.head is not None and table is None:  # the head's next step reads x_{k-1} as a token id
                prev = self.token_ids(index)
            picks.append(index)
            probs.append(p)
        return torch.stack(picks, 1), probs

    # ---- training -----------------------------------------------------------------------
    def forward(self, *args, exits: bool = False, **kwargs):
        """`train_forward`, or `exit_forward` (exits), so a DistributedDataParallel wrapper can run either."""
        return (self.exit_forward if exits else self.train_forward)(*args, **kwargs)

    def train_forward(self, taps: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                      conf_stop_grad: bool = False, fed: torch.Tensor | None = None):
        """Teacher-forced block predictions.

        taps [B, T, m*d] target features, tokens [B, T], anchors [B, A] positions (each with
        gamma valid tokens after it) -> logits [B, A, g, V] (base + sequential bias) and
        confidence logits [B, A, g] (or None). conf_stop_grad keeps the confidence loss from
        moving the backbone and the head (it then trains only the confidence head). fed [B, A] bool:
        blocks whose slots after the anchor read the text's tokens x_1..x_{g-1} instead of masks, as a
        refining pass reads a draft (a causal block only: slot k then sees x_0..x_k and predicts x_{k+1}).
        """
        self.check_trainable()
        if self.config.slots != self.gamma or not self.config.anchor_slot:
            raise RuntimeError("training runs gamma-slot blocks whose anchor slot predicts x_1; this drafter's "
                               f"block has {self.config.slots} slots (anchor_slot={self.config.anchor_slot})")
        b, a, g = anchors.shape[0], anchors.shape[1], self.gamma
        offs = torch.arange(g, device=tokens.device)
        block_pos = anchors[..., None] + offs  # [B, A, g]
        last = tokens.shape[1] - 1
        prev = tokens.gather(1, block_pos.clamp(max=last).flatten(1)).view(b, a, g)  # x_0..x_{g-1}, teacher
        mask = block_mask(anchors, g, taps.shape[1], self.config.causal_block)
        h_ctx = self.backbone.context(taps)
        x = self.backbone.block_start(self.embed(self.fed_inputs(prev, fed)), before_anchor(h_ctx, anchors))
        hidden = self.anchored(
            self.backbone.forward_dense(x.flatten(1, 2), block_pos.flatten(1), h_ctx, mask, g).view(b, a, g, -1))
        return self.scored(hidden, prev, self.conf, conf_stop_grad)

    def exit_forward(self, taps: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                     conf_stop_grad: bool = False, fed: torch.Tensor | None = None):
        """`train_forward` of the exit: logits [B, A, 1, V] of x_1 from its layer after `exit_layer` backbone layers,
        and the exit's confidence logits [B, A, 1] (or None). The anchor slot of a causal block reads only the context and
        the anchor, so this is what a one-position proposal computes; `fed` changes nothing there."""
        if self.exit is None:
            raise RuntimeError("this drafter has no exit (DrafterConfig.exit_mlp)")
        b, a = anchors.shape
        prev = tokens.gather(1, anchors)[..., None]  # x_0 [B, A, 1]
        h_ctx = self.backbone.context(taps)
        x = self.backbone.block_start(self.embed(prev), before_anchor(h_ctx, anchors)).flatten(1, 2)
        x = self.backbone.run_dense(x, anchors, h_ctx, block_mask(anchors, 1, taps.shape[1], True), 1,
                                    self.config.exit_layer, self.exit.layer)
        return self.scored(self.exit.norm(x).view(b, a, 1, -1), prev, self.exit.conf, conf_stop_grad)

    def scored(self, hidden: torch.Tensor, prev: torch.Tensor, conf_head, conf_stop_grad: bool):
        """Teacher-forced hidden [B, A, g, d] of blocks reading prev [B, A, g] (x_0..x_{g-1}) -> logits (base +
        sequential bias) and conf_head's confidence logits (None without one)."""
        logits = self.lm_head(hidden)
        conf, emb = None, None
        if self.head is not None:
            bias, emb = self.head.teacher(hidden, prev)
            logits = logits + bias.float()
        if conf_head is not None:
            emb = emb if self.config.confidence_markov else None
            conf = conf_head(hidden.detach(), None if emb is None else emb.detach()) if conf_stop_grad \
                else conf_head(hidden, emb)
        return logits, conf


def refined(read: DraftBlock, second: DraftBlock) -> tuple[DraftBlock, bool]:
    """A greedy refining pass's block (its slot k read `read`'s x_1..x_{k-1}): its tokens and confidences, each
    request's kept up to and including its first token that differs from `read`'s, after which the pass read
    a draft that is no longer the block's (`num_valid`; confidences past it 0); and whether no token differed."""
    same = torch.cumprod((read.tokens == second.tokens).long(), 1)  # [R, d]: agreeing through k
    valid = (same[:, :-1].sum(1) + 1).tolist()  # through the first difference (all d where they agree)
    if second.confidence is not None:
        keep = torch.arange(second.tokens.shape[1], device=same.device)[None, :] < upload(valid, same.device)[:, None]
        second.confidence = second.confidence * keep
    second.num_valid = valid
    return second, bool(same[:, -1].all())


def before_anchor(h_ctx: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """H_ctx [B, T, d] at the position before each anchor [B, A] -> [B, A, d] (zero for an anchor at 0)."""
    idx = (anchors - 1).clamp(min=0)
    h = h_ctx.gather(1, idx[..., None].expand(-1, -1, h_ctx.shape[-1]))
    return h * (anchors > 0)[..., None].to(h.dtype)


def block_mask(anchors: torch.Tensor, gamma: int, ctx_len: int, causal: bool = False) -> torch.Tensor:
    """[B, 1, A*g, T + A*g] bool: block a sees context before its anchor and its own block (causal:
    only its own slots up to each query's)."""
    b, a = anchors.shape
    dev = anchors.device
    q_block = torch.arange(a, device=dev).repeat_interleave(gamma)  # [A*g]
    ctx = torch.arange(ctx_len, device=dev)[None, None, :] < anchors.repeat_interleave(gamma, 1)[:, :, None]
    own = q_block[:, None] == q_block[None, :]
    if causal:
        slot = torch.arange(gamma, device=dev).repeat(a)
        own = own & (slot[None, :] <= slot[:, None])
    return torch.cat([ctx, own[None].expand(b, -1, -1)], dim=-1)[:, None]

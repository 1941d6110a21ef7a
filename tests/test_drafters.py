"""Drafter invariants: attention masks, serving path == training path (cached context K/V,
sequential bias sampled == teacher-forced), loss terms, anchors, save/load round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.drafters.base import ContextRow, DrafterConfig, ProposeInput, save_drafter
from dspark.drafters.block import block_mask
from dspark.drafters.registry import default_taps, load_drafter, new_config, new_drafter
from dspark.kv_cache import PagedKVCache
from dspark.models.loader import load_model
from dspark.sampling import SamplingParams, SamplingRows
from dspark.train.anchors import make_batch
from dspark.train.losses import LossWeights, acceptance, drafter_loss, position_weights


@pytest.fixture(scope="module")
def target(qwen3_dir):
    net, tok = load_model(qwen3_dir)
    return net


def bound(kind: str, target, **over):
    torch.manual_seed(1)
    d = new_drafter(new_config(kind, target.config, 5, **over))
    with torch.no_grad():  # non-trivial sequential head and confidence weights
        for name, p in d.named_parameters():
            if "w2" in name or "conf" in name or "mix_out" in name:  # mix_out: an mlp head's correction
                p.normal_(0, 0.3)
    d.bind(target, 64, 4)
    return d


def serve_vs_train(kind: str, target, context: list[int], head: str = "markov", **over):
    """Greedy proposal through the paged serving path, then the teacher-forced training
    forward over context + the drafted tokens: per-position logits must agree."""
    d = bound(kind, target, **({"head": head} if kind == "dspark" else {}), **over)
    if d.config.context_residual:  # a trained projection, not the zero it starts at
        with torch.no_grad():
            d.backbone.residual.weight.normal_(0, 0.3)
    if getattr(d, "anchor", None) is not None:
        with torch.no_grad():
            d.anchor.down_proj.weight.normal_(0, 0.3)
    for mlp in getattr(getattr(d, "backbone", None), "slot_mlps", None) or ():
        with torch.no_grad():
            mlp.down.normal_(0, 0.3)
    ids = torch.tensor([context])
    with torch.no_grad():
        _, taps = target.forward_dense(ids, d.taps)
    anchor_pos = len(context) - 1
    d.extend([ContextRow("r", 0, context[:-1], taps[0, :-1])])
    block = d.propose([ProposeInput("r", context[-1], anchor_pos, context)],
                      SamplingRows.same(1, SamplingParams(temperature=0.0)))
    drafted = block.tokens[0].tolist()
    full = torch.tensor([context + drafted])
    with torch.no_grad():
        _, taps_full = target.forward_dense(full, d.taps)
        logits, conf = d.train_forward(taps_full, full, torch.tensor([[anchor_pos]]))
    return d, block, logits[0, 0], conf


@pytest.mark.parametrize("head", ["markov", "gated", "rnn", "mlp"])
def test_dspark_serving_equals_teacher_forced(target, head):
    d, block, logits, conf = serve_vs_train("dspark", target, list(range(3, 20)), head)
    assert block.tokens[0].tolist() == logits.argmax(-1).tolist()  # greedy: same tokens
    assert conf is not None and torch.allclose(block.confidence[0], torch.sigmoid(conf[0, 0]), atol=1e-5)
    assert d.pool.length("r") == 16  # the block's temporary slots were rolled back


def test_an_mlp_head_reads_the_draft_before_each_position(target):
    """The mlp head's correction enters every position's logits (zeroing it changes them); a sampled proposal draws
    each position from the softmax of its teacher-forced logits given the tokens drawn before it; a greedy one over
    a draft vocabulary takes each position's argmax over that vocabulary."""
    context = list(range(3, 20))
    d, block, logits, _ = serve_vs_train("dspark", target, context, "mlp")
    inp = [ProposeInput("r", context[-1], len(context) - 1, context)]
    sampled = d.propose(inp, SamplingRows.same(1, SamplingParams(temperature=1.0, seed=3)))
    assert torch.allclose(sampled.probs[0], teacher_logits(d, target, context, sampled).softmax(-1), atol=1e-5)
    ids = torch.arange(0, d.config.vocab_size, 2)
    d.restrict_vocab(ids.tolist())
    narrow = d.propose(inp, SamplingRows.same(1, SamplingParams(temperature=0.0)))
    d.restrict_vocab(None)
    assert narrow.tokens[0].tolist() == ids[teacher_logits(d, target, context, narrow)[:, ids].argmax(-1)].tolist()
    without = teacher_forced_without(d, target, context, block, d.head.mix_out.weight)
    assert not torch.allclose(logits, without, atol=1e-3)


def teacher_logits(d, target, context: list[int], block) -> torch.Tensor:
    """The block's teacher-forced logits [g, V] over context + its drafted tokens."""
    full = torch.tensor([context + block.tokens[0].tolist()])
    with torch.no_grad():
        _, taps = target.forward_dense(full, d.taps)
        teacher, _ = d.train_forward(taps, full, torch.tensor([[len(context) - 1]]))
    return teacher[0, 0]


def test_greedy_requests_read_the_greedy_temperatures(target):
    """A drafter calibrated on both kinds of rollouts: the served confidences of a greedy request are
    sigmoid(logit / T_greedy), as trained; a sampled request in the same batch keeps T_sampled."""
    temps, greedy = (0.5, 0.6, 0.7, 0.8, 0.9, 1.1, 1.2), (2.0, 2.1, 2.2, 2.3, 2.4, 2.5, 2.6)
    d, block, _, conf = serve_vs_train("dspark", target, list(range(3, 20)), sts_temperatures=temps, sts_greedy=greedy)
    assert conf is not None and torch.allclose(block.confidence[0], torch.sigmoid(conf[0, 0] / torch.tensor(greedy)),
                                               atol=1e-5)
    context = list(range(3, 20))
    with torch.no_grad():
        _, taps = target.forward_dense(torch.tensor([context]), d.taps)
    for r in ("g", "s"):
        d.extend([ContextRow(r, 0, context[:-1], taps[0, :-1])])
    rows = SamplingRows.build([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=0)])
    both = d.propose([ProposeInput(r, context[-1], len(context) - 1, context) for r in ("g", "s")], rows)
    raw = both.confidence_logits
    assert torch.allclose(both.confidence[0], torch.sigmoid(raw[0] / torch.tensor(greedy)), atol=1e-6)
    assert torch.allclose(both.confidence[1], torch.sigmoid(raw[1] / torch.tensor(temps)), atol=1e-6)


def teacher_forced_without(d, target, context: list[int], block, weight: torch.Tensor) -> torch.Tensor:
    """The block's teacher-forced logits [g, V] over context + its drafted tokens with `weight` zeroed."""
    with torch.no_grad():
        weight.zero_()
    return teacher_logits(d, target, context, block)


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_context_residual_serving_equals_teacher_forced(target, kind):
    context = list(range(3, 20))
    d, block, logits, conf = serve_vs_train(kind, target, context, context_residual=True)
    assert block.tokens[0].tolist() == logits.argmax(-1).tolist()
    without = teacher_forced_without(d, target, context, block, d.backbone.residual.weight)
    assert not torch.allclose(logits, without, atol=1e-3)  # the feature really enters the block


@pytest.mark.parametrize("causal", [False, True])
def test_anchor_mlp_serving_equals_teacher_forced(target, causal):
    """The anchor slot's own MLP runs in both paths and moves the first position only."""
    context = list(range(3, 20))
    d, block, logits, _ = serve_vs_train("dspark", target, context, anchor_mlp=32, causal_block=causal)
    assert block.tokens[0].tolist() == logits.argmax(-1).tolist()
    without = teacher_forced_without(d, target, context, block, d.anchor.down_proj.weight)
    assert not torch.allclose(logits[0], without[0], atol=1e-3)  # it enters the first position
    assert torch.allclose(logits[1:], without[1:], atol=1e-5)  # and no other: it runs after the backbone


@pytest.mark.parametrize(("field", "refused"), [("anchor_mlp", "anchor slot"), ("slot_mlp", "slot_mlp")])
def test_a_drafter_grown_an_mlp_starts_as_the_drafter_it_grows_from(target, field, refused):
    """The anchor slot's MLP and the per-slot MLPs start at zero: the grown drafter computes what the old one did;
    neither is a DFlash option, and neither exports to DeepSpec's format."""
    from dspark.drafters.formats.deepspec import check_exportable
    from dspark.train import surgery

    d = bound("dspark", target)
    grown = getattr(surgery, f"with_{field}")(d, 24)
    (a, ca), (b, cb) = old_and_grown(d, grown, target)
    assert getattr(grown.config, field) == 24 and torch.equal(a, b) and torch.equal(ca, cb)
    with pytest.raises(ValueError, match=refused):
        new_config("dflash", target.config, 5, **{field: 32})
    with pytest.raises(ValueError, match=field):
        check_exportable(grown.config)


@pytest.mark.parametrize("causal", [False, True])
def test_slot_mlp_serving_equals_teacher_forced(target, causal):
    """Each slot's own MLPs run in both paths (a flat serving batch and dense training blocks alike), and a slot's
    MLP moves that slot: zeroing the first slot's moves the first position."""
    context = list(range(3, 20))
    d, block, logits, _ = serve_vs_train("dspark", target, context, slot_mlp=16, causal_block=causal)
    assert block.tokens[0].tolist() == logits.argmax(-1).tolist()
    without = teacher_forced_without(d, target, context, block, d.backbone.slot_mlps[1].down)
    assert not torch.allclose(logits, without, atol=1e-3)


def test_slot_mlps_are_per_slot_and_cut_with_the_block(target):
    """A causal block drafted one position deep runs only the first slot's MLPs: the same first token and
    confidence as the whole block's; and changing slot 2's weights leaves slots 0 and 1 unchanged."""
    context = list(range(3, 20))
    d = bound("dspark", target, slot_mlp=16, causal_block=True)
    with torch.no_grad():
        for mlp in d.backbone.slot_mlps:
            mlp.down.normal_(0, 0.3)
        _, taps = target.forward_dense(torch.tensor([context]), d.taps)
    d.extend([ContextRow("r", 0, context[:-1], taps[0, :-1])])
    greedy = SamplingRows.same(1, SamplingParams(temperature=0.0))
    inp = [ProposeInput("r", context[-1], len(context) - 1, context)]
    whole, one = d.propose(inp, greedy), d.propose(inp, greedy, 1)
    assert one.tokens[0, 0] == whole.tokens[0, 0]
    assert torch.allclose(one.confidence[0, 0], whole.confidence[0, 0], atol=1e-6)
    block = d.propose(inp, greedy)
    full = torch.tensor([context + block.tokens[0].tolist()])
    with torch.no_grad():
        _, taps_full = target.forward_dense(full, d.taps)
        before, _ = d.train_forward(taps_full, full, torch.tensor([[len(context) - 1]]))
        d.backbone.slot_mlps[0].down[2].normal_(0, 0.3)
        after, _ = d.train_forward(taps_full, full, torch.tensor([[len(context) - 1]]))
    assert torch.allclose(before[0, 0, :2], after[0, 0, :2], atol=1e-5)
    assert not torch.allclose(before[0, 0, 2], after[0, 0, 2], atol=1e-3)


def old_and_grown(old, grown, target):
    """Teacher-forced (logits, confidences) of a drafter and of one grown from it, on the same tokens."""
    grown._target = [target]
    tokens = torch.arange(3, 23)[None]
    with torch.no_grad():
        _, taps = target.forward_dense(tokens, old.taps)
        return [d.train_forward(taps, tokens, torch.tensor([[0, 8]])) for d in (old, grown)]


def test_context_residual_starts_as_the_drafter_it_grows_from(target):
    from dspark.train.surgery import with_context_residual

    d = bound("dspark", target)
    wide = with_context_residual(d)
    (a, ca), (b, cb) = old_and_grown(d, wide, target)
    assert wide.config.context_residual and torch.equal(a, b) and torch.equal(ca, cb)
    with pytest.raises(ValueError, match="block-backbone option"):
        new_config("eagle3", target.config, 5, context_residual=True)


@pytest.mark.parametrize(("head", "rank", "atol"),
                         [("markov", 96, 1e-5), ("gated", 64, 0.05), ("rnn", 64, 0.05), ("mlp", 64, 1e-5)])
def test_a_reheaded_drafter_starts_from_the_markov_head_it_grows_from(target, head, rank, atol):
    """A wider Markov head computes the old logits and confidences (up to rounding), and so does an mlp head (its
    correction starts at zero); a gated or RNN head starts close to them (an open gate; tanh of a small embedding);
    the backbone is carried whole."""
    from dspark.train.surgery import reheaded

    d = bound("dspark", target)
    with torch.no_grad():
        d.head.w1.weight.normal_(0, 0.05)  # a trained embedding's scale
    new = reheaded(d, head, rank)
    (a, ca), (b, cb) = old_and_grown(d, new, target)
    assert (new.config.head, new.config.rank) == (head, rank)
    assert torch.allclose(a, b, atol=atol, rtol=0) and torch.allclose(ca, cb, atol=atol, rtol=0)
    assert head in ("markov", "mlp") or not torch.allclose(a, b, atol=1e-5, rtol=0)  # another function
    with pytest.raises(ValueError, match="rehead"):
        reheaded(d, "markov", 32)


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "mtp"])
def test_baselines_serving_equals_teacher_forced(target, kind):
    _, block, logits, _ = serve_vs_train(kind, target, list(range(3, 20)))
    assert block.tokens[0].tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_causal_block_serving_equals_teacher_forced(target, kind):
    _, block, logits, conf = serve_vs_train(kind, target, list(range(3, 20)), causal_block=True)
    assert block.tokens[0].tolist() == logits.argmax(-1).tolist()
    assert kind == "dflash" or torch.allclose(block.confidence[0], torch.sigmoid(conf[0, 0]), atol=1e-5)


@pytest.mark.parametrize(("kind", "over"), [("dspark", {"causal_block": True}), ("dflash", {"causal_block": True}),
                                          ("eagle3", {}), ("dspark", {})])
def test_a_shallower_proposal_is_the_first_positions_of_the_full_one(target, kind, over):
    """A drafter that cuts exactly proposes, at depth 3, the full block's first three tokens, distributions
    and confidences, and marks the rest invalid; a bidirectional block ignores the depth."""
    d = bound(kind, target, **over)
    context = list(range(3, 20))
    with torch.no_grad():
        _, taps = target.forward_dense(torch.tensor([context]), d.taps)
    d.extend([ContextRow("r", 0, context[:-1], taps[0, :-1])])
    inputs = [ProposeInput("r", context[-1], len(context) - 1, context)]
    rows = SamplingRows.same(1, SamplingParams(temperature=0.0))
    full, cut = d.propose(inputs, rows), d.propose(inputs, rows, 3)
    assert d.cuts_exactly == (kind == "eagle3" or bool(over))
    if not d.cuts_exactly:
        assert torch.equal(full.tokens, cut.tokens) and cut.num_valid is None
        return
    assert cut.tokens.shape == full.tokens.shape and cut.num_valid == [3]
    assert torch.equal(cut.tokens[:, :3], full.tokens[:, :3]) and cut.probs is None and full.probs is None
    if full.confidence is not None:
        assert torch.allclose(cut.confidence[:, :3], full.confidence[:, :3], atol=1e-6) and not cut.confidence[:, 3:].any()


def test_causal_block_mask_sees_only_earlier_slots():
    anchors = torch.tensor([[2, 5]])
    own = block_mask(anchors, 3, 8, causal=True)[0, 0, :, 8:]
    tril = torch.ones(3, 3, dtype=torch.bool).tril()
    assert torch.equal(own[:3, :3], tril) and torch.equal(own[3:, 3:], tril) and not own[:3, 3:].any()


def test_block_mask_sees_only_context_before_the_anchor():
    anchors = torch.tensor([[2, 5]])
    mask = block_mask(anchors, 3, 8)[0, 0]  # [A*g, T + A*g]
    ctx, own = mask[:, :8], mask[:, 8:]
    assert ctx[:3].sum(1).tolist() == [2, 2, 2] and ctx[3:].sum(1).tolist() == [5, 5, 5]
    assert own[:3, :3].all() and not own[:3, 3:].any() and own[3:, 3:].all()


def test_context_at_or_after_the_anchor_does_not_leak(target):
    d = bound("dspark", target)
    tokens = torch.arange(3, 23)[None]
    with torch.no_grad():
        _, taps = target.forward_dense(tokens, d.taps)
        a, _ = d.train_forward(taps, tokens, torch.tensor([[8]]))
        taps2 = taps.clone()
        taps2[:, 8:] += torch.randn_like(taps2[:, 8:])
        tokens2 = tokens.clone()
        tokens2[:, 16:] = 7  # beyond the block's teacher inputs
        b, _ = d.train_forward(taps2, tokens2, torch.tensor([[8]]))
    assert torch.allclose(a, b, atol=1e-5)


def test_cached_context_kv_equals_recomputed(target):
    """Extending the context in pieces (as rounds do) equals one extension."""
    d1, d2 = bound("dspark", target), bound("dspark", target)
    ids = list(range(3, 20))
    with torch.no_grad():
        _, taps = target.forward_dense(torch.tensor([ids]), d1.taps)
    d1.extend([ContextRow("r", 0, ids, taps[0])])
    d2.extend([ContextRow("r", 0, ids[:5], taps[0, :5])])
    d2.extend([ContextRow("r", 5, ids[5:9], taps[0, 5:9])])
    d2.extend([ContextRow("r", 9, ids[9:], taps[0, 9:])])
    for c1, c2 in zip(d1.cache.layers, d2.cache.layers, strict=True):
        s1 = torch.tensor(d1.pool.slots("r", 0, len(ids)))
        s2 = torch.tensor(d2.pool.slots("r", 0, len(ids)))
        assert torch.allclose(c1[0][:, s1], c2[0][:, s2], atol=1e-6) and torch.allclose(c1[1][:, s1], c2[1][:, s2], atol=1e-6)


def test_loss_terms_on_hand_made_distributions():
    p = torch.tensor([[0.7, 0.2, 0.1]])
    logits = p.log()[None]  # [1, 1, V]
    same = drafter_loss("dspark", logits, torch.zeros(1, 1), logits, torch.tensor([[0]]), torch.ones(1, 1, dtype=torch.bool))
    assert same[1]["tv"] == pytest.approx(0.0, abs=1e-6)
    assert same[1]["ce"] == pytest.approx(-np.log(0.7), rel=1e-5)
    assert same[1]["conf"] == pytest.approx(np.log(2.0), rel=1e-5)  # BCE(sigmoid(0)=0.5, label 1)
    disjoint_d = torch.tensor([[[0.0, -30.0, -30.0]]])
    disjoint_t = torch.tensor([[[-30.0, 0.0, -30.0]]])
    out = drafter_loss("dspark", disjoint_d, torch.full((1, 1), 30.0), disjoint_t, torch.tensor([[1]]),
                       torch.ones(1, 1, dtype=torch.bool))
    assert out[1]["tv"] == pytest.approx(2.0, abs=1e-4)
    assert out[1]["conf"] == pytest.approx(30.0, rel=1e-3)  # label 0, confident 1
    assert acceptance(torch.tensor([0.5, 0.5]), torch.tensor([0.7, 0.3])).item() == pytest.approx(0.8)


def test_soft_ce_term_is_off_by_default_and_moves_disjoint_drafts():
    p = torch.tensor([[0.7, 0.2, 0.1]])
    logits, label, valid = p.log()[None], torch.tensor([[0]]), torch.ones(1, 1, dtype=torch.bool)
    plain = drafter_loss("dspark", logits, None, logits, label, valid)
    assert "soft_ce" not in plain[1]
    both = drafter_loss("dspark", logits, None, logits, label, valid, LossWeights(soft_ce=0.5))
    entropy = float(-(p * p.log()).sum())
    assert both[1]["soft_ce"] == pytest.approx(entropy, rel=1e-5)  # soft CE = H(p_t) when p_d = p_t
    assert float(both[0] - plain[0]) == pytest.approx(0.5 * entropy, rel=1e-5)
    # far-apart distributions: L1 is saturated (no gradient to speak of), soft CE still pulls p_d to p_t
    draft = torch.tensor([[[0.0, -30.0, -30.0]]], requires_grad=True)
    target = torch.tensor([[[-30.0, 0.0, -30.0]]])
    drafter_loss("dspark", draft, None, target, torch.tensor([[1]]), valid, LossWeights(ce=0.0))[0].backward()
    assert draft.grad.abs().max() < 1e-6
    draft.grad = None
    drafter_loss("dspark", draft, None, target, torch.tensor([[1]]), valid,
                 LossWeights(ce=0.0, soft_ce=1.0))[0].backward()
    assert draft.grad[0, 0, 1] < -0.5  # raise the target's token


def test_invalid_positions_do_not_count():
    logits = torch.randn(1, 2, 3)
    valid = torch.tensor([[True, False]])
    a = drafter_loss("dflash", logits[None], None, logits[None], torch.tensor([[[0, 1]]]), valid[None])[0]
    logits2 = logits.clone()
    logits2[0, 1] = 50.0
    b = drafter_loss("dflash", logits2[None], None, logits[None], torch.tensor([[[0, 1]]]), valid[None])[0]
    assert torch.allclose(a, b)


def test_anchors_are_response_tokens_with_valid_prefix_labels():
    rows = [{"prompt_ids": [1, 2, 3, 4], "response_ids": [10, 11, 12, 13, 14]},
            {"prompt_ids": [1, 2], "response_ids": [20, 21]}]
    batch = make_batch(rows, 16, 3, 4, np.random.default_rng(0))
    for i, row in enumerate(rows):
        p, length = len(row["prompt_ids"]), len(row["prompt_ids"]) + len(row["response_ids"])
        for a in range(4):
            if not batch.valid[i, a].any():
                continue
            pos = int(batch.anchors[i, a])
            assert p <= pos < length - 1
            v = batch.valid[i, a].tolist()
            assert v == sorted(v, reverse=True)  # a contiguous prefix
            for k in range(3):
                if v[k]:
                    assert int(batch.labels[i, a, k]) == int(batch.tokens[i, pos + k + 1])


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_save_load_round_trip(target, tmp_path, kind):
    d = bound(kind, target)
    save_drafter(d, d.config, tmp_path / kind)
    loaded = load_drafter(str(tmp_path / kind))
    assert loaded.config == d.config
    for (k1, v1), (k2, v2) in zip(d.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert k1 == k2 and torch.equal(v1, v2)


def test_drafter_config_rejects_bad_values():
    with pytest.raises(ValueError):
        DrafterConfig(kind="medusa")
    with pytest.raises(ValueError):
        DrafterConfig(head="none", confidence=True)


def test_paged_cache_budget_is_respected(target):
    cache = PagedKVCache(target.config, 4, 4, "cpu", torch.float32)
    assert cache.bytes == 2 * target.config.num_hidden_layers * 16 * target.config.num_key_value_heads * target.config.head_dim * 4


def test_default_taps_spread_over_depth_and_skip_the_last_layer():
    assert default_taps(6) == (0, 2, 4)
    assert default_taps(28) == (0, 9, 18)
    assert default_taps(2) == (0,)
    assert default_taps(4) == (0, 1, 2)
    for n in range(2, 64):
        taps = default_taps(n)
        assert taps[0] == 0 and max(taps) < n - 1 and len(set(taps)) == len(taps)


def scan_lookup(tokens: list[int], gamma: int, n_max: int, n_min: int) -> list[int]:
    """The n-gram rule by a plain scan: the latest earlier match of the longest suffix."""
    from dspark.drafters.ngram import continuation

    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[size - n :]:
                return continuation(tokens, start + n, gamma)
    return []


def test_ngram_index_grows_with_new_tokens_and_proposes_what_a_scan_finds():
    from dspark.drafters.ngram import SuffixIndex

    rng = np.random.default_rng(0)
    for vocab in (2, 3, 6):
        tokens: list[int] = []
        index = SuffixIndex(4, 1)
        for _ in range(60):
            tokens.extend(int(t) for t in rng.integers(0, vocab, size=int(rng.integers(1, 4))))
            assert index.lookup(tokens, 5) == scan_lookup(tokens, 5, 4, 1)
        assert index.size == len(tokens) - 1  # each token indexed once, when it was new


def test_first_position_weight_scales_its_share_of_the_loss():
    """`LossWeights.first` multiplies the first position's weight in the kind's schedule and nothing else."""
    logits, target = torch.randn(3, 2, 5), torch.randn(3, 2, 5)
    labels, valid = torch.randint(0, 5, (3, 2)), torch.ones(3, 2, dtype=torch.bool)
    per_pos = -(target.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean(0)  # EAGLE-3's soft CE per position
    w = position_weights(2, "cpu", "eagle3")
    for first in (1.0, 3.0):
        loss = drafter_loss("eagle3", logits, None, target, labels, valid, LossWeights(first=first))[0]
        expect = (first * w[0] * per_pos[0] + w[1] * per_pos[1]) / (first * w[0] + w[1])
        assert float(loss) == pytest.approx(float(expect), rel=1e-5)
    assert torch.equal(position_weights(4, "cpu", "dspark", 2.0)[1:], position_weights(4, "cpu", "dspark")[1:])


@pytest.mark.parametrize("passes", [1, 2])
def test_refined_proposal_is_the_fed_block_up_to_its_first_change(target, passes):
    """A refining pass (`DrafterConfig.refine`) reads the previous pass's draft in its slots: its tokens are the
    teacher-forced argmaxes of a fed block over that draft, kept through the first one that changed."""
    context = list(range(3, 20))
    d = bound("dspark", target, causal_block=True, refine=passes)
    with torch.no_grad():
        _, taps = target.forward_dense(torch.tensor([context]), d.taps)
    d.extend([ContextRow("r", 0, context[:-1], taps[0, :-1])])
    greedy = SamplingRows.same(1, SamplingParams(temperature=0.0))
    inp = [ProposeInput("r", context[-1], len(context) - 1, context)]
    block = d.propose(inp, greedy)
    d.config = d.config.replace(refine=passes - 1)
    read = d.propose(inp, greedy).tokens[0].tolist()  # the draft the last pass read
    full = torch.tensor([context + read])
    with torch.no_grad():
        _, taps_full = target.forward_dense(full, d.taps)
        fed, _ = d.train_forward(taps_full, full, torch.tensor([[len(context) - 1]]),
                                 fed=torch.ones(1, 1, dtype=torch.bool))
    second = fed[0, 0].argmax(-1).tolist()
    changed = next(k for k in range(len(read)) if read[k] != second[k])  # random weights: each pass changes a token
    valid = block.num_valid[0]
    assert valid == changed + 1 and block.tokens[0, :valid].tolist() == second[:valid]
    assert block.confidence is not None and bool((block.confidence[0, valid:] == 0).all())
    assert d.pool.length("r") == 16  # every pass's temporary slots were rolled back


def test_refining_needs_a_causal_block(target):
    with pytest.raises(ValueError, match="causal"):
        new_config("dspark", target.config, 5, refine=1)
    d = bound("dspark", target)  # a bidirectional block cannot be fed the tokens it predicts
    with pytest.raises(ValueError, match="causal"):
        d.train_forward(torch.zeros(1, 4, len(d.taps) * target.config.hidden_size), torch.zeros(1, 4, dtype=torch.long),
                        torch.zeros(1, 1, dtype=torch.long), fed=torch.ones(1, 1, dtype=torch.bool))


def test_a_refining_pass_keeps_each_draft_through_its_first_change():
    from dspark.drafters.base import DraftBlock
    from dspark.drafters.block import refined

    read = DraftBlock(torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]]), None, torch.full((2, 4), 0.9))
    second = DraftBlock(torch.tensor([[5, 9, 7, 8], [5, 6, 7, 8]]), None, torch.full((2, 4), 0.8))
    block, settled = refined(read, second)
    assert block.num_valid == [2, 4] and not settled  # row 0 keeps 5, 9 (9 read 5, its own x_1); row 1 all
    assert torch.equal(block.confidence, torch.tensor([[0.8, 0.8, 0.0, 0.0], [0.8] * 4]))
    same = DraftBlock(torch.tensor([[5, 6, 7, 8]]), None, None)
    assert refined(same, DraftBlock(torch.tensor([[5, 6, 7, 8]]), None, None))[1]

"""A pair of neural drafters (`dspark+mtp`, `drafters/pair.py`): one-position proposals from the second, deeper ones
from the first, each fed its own target layers. Greedy output equals plain decoding under every policy, each depth's
proposal is its part's own, the sampled output follows the target (chi-square, as for routing), and a pair that could
not cut its block, or that names a copy drafter, is refused with a reason."""

from __future__ import annotations

import pytest
import torch

from dspark.config import EngineConfig
from dspark.drafters.base import ContextRow, ProposeInput, save_drafter
from dspark.drafters.pair import PairedDrafter, own_columns
from dspark.drafters.registry import load_drafter, new_config, new_drafter
from dspark.engine.factory import assemble
from dspark.engine.gate import GateConfig
from dspark.models.loader import load_model
from dspark.sampling import SamplingParams, SamplingRows
from tests.test_route import exact_joint, pvalue, sampled_joint, small_vocab  # noqa: F401 (a fixture)
from tests.test_spec_engine import engine_for, run


def parts(net, tok, **over):
    """A random causal DSpark block and a random MTP layer for this target (fixed seeds)."""
    mask = tok.token_id("<|mask|>") or 0
    torch.manual_seed(0)
    deep = new_drafter(new_config("dspark", net.config, mask, causal_block=True, **over))
    torch.manual_seed(1)
    return deep, new_drafter(new_config("mtp", net.config, mask))


def paired(path, policy: str, **kw):
    net, tok = load_model(path)
    cfg = EngineConfig(**{"device": "cpu", "block_size": 4, "max_num_batched_tokens": 96, **kw})
    return assemble(net, tok, cfg, drafter=PairedDrafter(*parts(net, tok)), policy=policy,
                    gate=GateConfig(enabled=False))


@pytest.mark.parametrize("policy", ["static:1", "static:3", "static:7", "threshold:0.3", "dspark"])
def test_greedy_identical_and_each_depth_drafted_by_its_part(qwen3_dir, policy):
    reference = [o.token_ids for o in run(engine_for(qwen3_dir))]
    engine = paired(qwen3_dir, policy)
    outs = run(engine)
    assert [o.token_ids for o in outs] == reference, policy
    assert engine.drafter.cache_bytes_in_use() == 0 and not any(engine.drafter.waiting.values())
    drafted = {k for o in outs for k, n in o.stats["draft_tokens_by"].items() if n}
    assert drafted == ({"mtp"} if policy == "static:1" else {"dspark"}), drafted


def test_each_part_reads_its_own_taps_and_proposes_as_it_would_alone(qwen3_dir):
    net, tok = load_model(qwen3_dir)
    pair = PairedDrafter(*parts(net, tok))
    alone = parts(net, tok)  # the same weights, served on their own
    pair.bind(net, 64, 4)
    for d in alone:
        d.bind(net, 64, 4)
    assert pair.taps == tuple(sorted(set(alone[0].taps) | set(alone[1].taps)))
    ids = list(range(3, 20))
    with torch.inference_mode():
        _, taps = net.forward_dense(torch.tensor([ids]), pair.taps)
    d = net.config.hidden_size
    pair.extend([ContextRow("r", 0, ids[:-1], taps[0, :-1])])
    for drafter in alone:
        cols = [pair.taps.index(t) for t in drafter.taps]
        own = taps[0, :-1].view(len(ids) - 1, len(pair.taps), d)[:, cols].reshape(len(ids) - 1, -1)
        drafter.extend([ContextRow("r", 0, ids[:-1], own)])
    inp = [ProposeInput("r", ids[-1], len(ids) - 1, ids)]
    rows = SamplingRows.same(1, SamplingParams(temperature=0.0))
    one, three = pair.propose(inp, rows, 1), pair.propose(inp, rows, 3)
    assert one.sources == ["mtp"] and one.num_valid == [1] and one.tokens.shape == (1, pair.gamma)
    assert one.tokens[0, 0] == alone[1].propose(inp, rows, 1).tokens[0, 0]
    assert torch.equal(three.tokens[:, :3], alone[0].propose(inp, rows, 3).tokens[:, :3])
    assert three.confidence is not None and one.confidence is None
    pair.extend([ContextRow("r", len(ids) - 1, ids[-1:], taps[0, -1:])])  # waits for the part that drafts next
    assert all(len(w) == 1 for w in pair.waiting.values())
    pair.free("r")
    assert pair.cache_bytes_in_use() == 0 and not any(pair.waiting.values())


def test_own_columns_cuts_side_by_side_and_scattered_taps():
    """A part's columns of a row that carries four tapped layers of width 3: a run of columns and a scattered set."""
    feats = torch.arange(24.0).view(2, 12)
    row = ContextRow("r", 5, [1, 2], feats)
    assert torch.equal(own_columns(row, [1, 2], 4).features, feats[:, 3:9])
    assert torch.equal(own_columns(row, [0, 3], 4).features, torch.cat([feats[:, 0:3], feats[:, 9:12]], dim=1))
    assert torch.equal(own_columns(row, [2, 0], 4).features, torch.cat([feats[:, 6:9], feats[:, 0:3]], dim=1))
    assert own_columns(row, [0, 1, 2, 3], 4) is row


def test_a_pair_that_cannot_cut_or_names_a_copy_drafter_is_refused(qwen3_dir, tmp_path):
    net, tok = load_model(qwen3_dir)
    mask = tok.token_id("<|mask|>") or 0
    whole = new_drafter(new_config("dspark", net.config, mask))  # a bidirectional block runs whole
    with pytest.raises(ValueError, match="bidirectional"):
        PairedDrafter(whole, new_drafter(new_config("mtp", net.config, mask)))
    with pytest.raises(ValueError, match="name it second"):
        PairedDrafter(*reversed(parts(net, tok)))  # MTP-1 first: it has no deeper blocks to propose
    with pytest.raises(ValueError, match="copy drafter"):
        load_drafter("dspark+ngram", qwen3_dir, net.config, mask)
    odd = tmp_path / "dspark+v2"  # a checkpoint directory whose name holds a '+' is a directory, not a pair
    deep, _ = parts(net, tok)
    save_drafter(deep, deep.config, odd)
    assert not isinstance(load_drafter(str(odd), qwen3_dir, net.config, mask), PairedDrafter)


def test_the_training_tools_refuse_a_pair_with_a_reason(qwen3_dir, tmp_path):
    from dspark.train.drafter import DrafterTrainConfig, initial_drafter
    from dspark.train.eval_drafter import load_against

    net, tok = load_model(qwen3_dir)
    for part, name in zip(parts(net, tok), ("deep", "one"), strict=True):
        save_drafter(part, part.config, tmp_path / name)
    pair = f"{tmp_path / 'deep'}+{tmp_path / 'one'}"
    assert isinstance(load_drafter(pair, None, net.config), PairedDrafter)
    with pytest.raises(ValueError, match="not one drafter"):
        load_against(pair, net, DrafterTrainConfig())
    with pytest.raises(ValueError, match="not one drafter"):
        initial_drafter(DrafterTrainConfig(init_from=pair), net.config)


def test_sampled_output_follows_the_target_with_a_pair(small_vocab):  # noqa: F811
    p = exact_joint(small_vocab)
    counts, by = sampled_joint(paired(small_vocab, "static:1", max_num_seqs=128, max_num_batched_tokens=2048))
    assert set(by) == {"mtp"} and by["mtp"] > 0
    assert pvalue(counts, p) > 1e-3

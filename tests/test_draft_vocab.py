"""Draft vocabularies (`dspark draft-vocab`, `--draft-vocab N`): the token counts file, the
restricted proposal for greedy batches (tokens inside the set) and the whole vocabulary for
batches that sample, the profile timing both, greedy output identical to plain decoding for
every neural drafter, and clear errors for bad input."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch

from dspark.cli import main
from dspark.config import EngineConfig
from dspark.drafters.base import ProposeInput, save_drafter
from dspark.drafters.registry import new_config, new_drafter
from dspark.drafters.vocab import count_tokens, coverage, expected_counts, read_counts, top_ids, write_counts
from dspark.engine.factory import assemble, build_engine
from dspark.models.loader import load_model
from dspark.sampling import SamplingParams, SamplingRows
from tests.test_spec_engine import PROMPTS, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def engine_for(path, kind, policy, ids):
    net, tok = load_model(path)
    torch.manual_seed(0)
    drafter = new_drafter(new_config(kind, net.config, tok.token_id("<|mask|>") or 0))
    engine = assemble(net, tok, EngineConfig(device="cpu", block_size=4, max_num_batched_tokens=96),
                       drafter=drafter, policy=policy)
    drafter.restrict_vocab(ids)
    return engine


@pytest.fixture(scope="module")
def plain(qwen3_dir):
    net, tok = load_model(qwen3_dir)
    engine = assemble(net, tok, EngineConfig(device="cpu", block_size=4, max_num_batched_tokens=96))
    return [o.token_ids for o in run(engine, PROMPTS[::3], GREEDY)]


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3", "mtp"])
def test_greedy_output_unchanged_with_a_draft_vocabulary(qwen3_dir, plain, kind):
    vocab = load_model(qwen3_dir)[0].config.vocab_size
    for policy in ("static:7", "dspark"):
        engine = engine_for(qwen3_dir, kind, policy, list(range(0, vocab, 2)))  # half the tokens
        assert [o.token_ids for o in run(engine, PROMPTS[::3], GREEDY)] == plain, (kind, policy)


def propose(drafter, rows):
    inputs = [ProposeInput("r", anchor=5, context_len=0, tokens=[5], generator=torch.Generator().manual_seed(1))]
    drafter.pool.append("r", 0)
    return drafter.propose(inputs, rows)


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_greedy_batches_draft_inside_the_set_and_sampling_ones_over_every_token(qwen3_dir, kind):
    engine = engine_for(qwen3_dir, kind, "static:7", None)
    drafter, vocab = engine.drafter, engine.model.config.vocab_size
    greedy, sampled = (SamplingRows.same(1, SamplingParams(temperature=t)) for t in (0.0, 1.0))
    full = propose(drafter, greedy)
    ids = list(range(vocab - 1, -1, -1))  # every token, in another order: the same greedy block
    drafter.restrict_vocab(ids)
    again = propose(drafter, greedy)
    assert torch.equal(full.tokens, again.tokens) and full.probs is None and again.probs is None
    subset = list(range(1, vocab, 3))
    drafter.restrict_vocab(subset)
    assert drafter.splits_vocab
    assert set(propose(drafter, greedy).tokens.flatten().tolist()) <= set(subset)
    block = propose(drafter, sampled)  # a batch that samples drafts over every token
    assert block.probs.shape[-1] == vocab
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[subset] = False
    assert float(block.probs[..., outside].sum(-1).min()) > 0.0
    assert torch.allclose(block.probs.sum(-1), torch.ones(1, drafter.gamma))
    assert set(propose(drafter, greedy).tokens.flatten().tolist()) <= set(subset)  # and greedy is narrow again
    with pytest.raises(RuntimeError, match="serves only"):
        drafter.train_forward(torch.zeros(1, 8, len(drafter.taps) * drafter.config.hidden_size),
                              torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    drafter.restrict_vocab(None)
    assert not drafter.splits_vocab and propose(drafter, sampled).probs.shape[-1] == vocab


def test_a_batch_mixing_greedy_and_sampling_rows_drafts_over_every_token(qwen3_dir):
    """One sampling row widens the whole proposal: its greedy row then drafts the full vocabulary's argmax."""
    engine = engine_for(qwen3_dir, "dspark", "static:7", None)
    drafter, vocab = engine.drafter, engine.model.config.vocab_size
    with torch.no_grad():  # a head that moves the logits, so the narrow and the full block differ
        drafter.head.w2.weight.normal_(std=2.0)
    full = propose(drafter, SamplingRows.same(1, SamplingParams(temperature=0.0))).tokens
    drafter.pool.free("r")
    drafter.restrict_vocab([t for t in range(vocab) if t not in set(full.flatten().tolist())])
    rows = SamplingRows.build([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)])
    inputs = [ProposeInput(sid, anchor=5, context_len=0, tokens=[5], generator=torch.Generator().manual_seed(1))
              for sid in ("a", "b")]
    for sid in ("a", "b"):
        drafter.pool.append(sid, 0)
    mixed = drafter.propose(inputs, rows)
    assert torch.equal(mixed.tokens[0], full[0])  # outside the draft vocabulary: drafted over every token


def test_markov_table_drafts_what_the_head_product_drafts(qwen3_dir):
    """Over a draft vocabulary (a greedy batch) the markov bias after a draft token is read from its
    table row; the block (tokens, confidences) is the one the lookup-and-product step gives."""
    engine = engine_for(qwen3_dir, "dspark", "static:7", None)
    drafter = engine.drafter
    with torch.no_grad():  # a head that moves the logits, so a wrong row would change the draft
        drafter.head.w2.weight.normal_(std=2.0)
    drafter.restrict_vocab(list(range(1, drafter.config.vocab_size, 2)))
    head = drafter.head
    assert head.table is not None and head.table.shape == (len(drafter.vocab_ids),) * 2
    e = head.w1(drafter.vocab_ids[:5])
    assert torch.allclose(head.table[:5], head.out(e).float(), atol=1e-5)
    rows = SamplingRows.same(1, SamplingParams(temperature=0.0))
    by_table = propose(drafter, rows)
    drafter.pool.free("r")
    head.table = None
    by_product = propose(drafter, rows)
    assert torch.equal(by_table.tokens, by_product.tokens)
    assert torch.allclose(by_table.confidence, by_product.confidence, atol=1e-6)
    drafter.pool.free("r")
    drafter.select_vocab(SamplingRows.same(1, SamplingParams(temperature=1.0)))
    assert head.active_table is None and head.out(e).shape[-1] == drafter.config.vocab_size


def test_bad_draft_vocabularies_are_refused(qwen3_dir):
    engine = engine_for(qwen3_dir, "dspark", "static:7", None)
    vocab = engine.model.config.vocab_size
    for bad in ([], [0, 0], [vocab], [-1]):
        with pytest.raises(ValueError, match="distinct token ids"):
            engine.drafter.restrict_vocab(bad)


def test_counts_file_ranks_tokens_and_reports_coverage(tmp_path, qwen3_dir):
    tok = load_model(qwen3_dir)[1]
    rows = [{"response_ids": [7, 7, 7, 3, 3, 9]}, {"text": "def add"}]
    counts = count_tokens(rows, tok)
    assert counts == Counter([7, 7, 7, 3, 3, 9, *tok.encode("def add")])
    write_counts(tmp_path, Counter({7: 3, 3: 2, 9: 1}), "x.jsonl")
    assert read_counts(tmp_path)["ids"] == [7, 3, 9]
    assert top_ids(tmp_path, 2) == [7, 3]
    assert coverage(tmp_path, [1, 2, 3]) == {1: 0.5, 2: pytest.approx(5 / 6), 3: 1.0}
    with pytest.raises(ValueError, match="1..3"):
        top_ids(tmp_path, 4)
    with pytest.raises(ValueError, match="response_ids"):
        count_tokens([{"prompt": "hi"}], tok)


def test_draft_vocab_command_and_engine_option(tmp_path, qwen3_dir, plain):
    model, drafter_dir = tmp_path / "model", tmp_path / "drafter"
    shutil.copytree(qwen3_dir, model)
    net, tok = load_model(model)
    torch.manual_seed(0)
    d = new_drafter(new_config("dspark", net.config, tok.token_id("<|mask|>") or 0))
    save_drafter(d, d.config, drafter_dir)
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=96)
    with pytest.raises(FileNotFoundError, match="dspark draft-vocab"):
        build_engine(model, str(drafter_dir), "static:7", cfg, profile="off", draft_vocab=8)
    data = tmp_path / "answers.jsonl"
    answers = [tok.encode(p) for p in PROMPTS]
    data.write_text("".join(json.dumps({"response_ids": a}) + "\n" for a in answers))
    assert main(["draft-vocab", "--model", str(model), "--data", str(data)]) == 0
    ranked = read_counts(model)["ids"]
    assert ranked[0] == Counter(t for a in answers for t in a).most_common(1)[0][0]
    with pytest.raises(ValueError, match="no LM head"):
        build_engine(model, "ngram", "static:7", EngineConfig(device="cpu"), profile="off", draft_vocab=8)
    with pytest.raises(ValueError, match="needs a drafter"):
        build_engine(model, None, "none", EngineConfig(device="cpu"), profile="off", draft_vocab=8)
    engine = build_engine(model, str(drafter_dir), "static:7", cfg, profile="off", draft_vocab=len(ranked) // 2)
    assert engine.drafter.vocab_ids.tolist() == ranked[: len(ranked) // 2]
    assert [o.token_ids for o in run(engine, PROMPTS[::3], GREEDY)] == plain


def test_expected_counts_sum_the_targets_distributions(qwen3_dir):
    net, tok = load_model(qwen3_dir)
    prompt, answer = tok.encode("def add(a, b):"), tok.encode(" return a + b")
    counts = expected_counts([{"prompt_ids": prompt, "response_ids": answer}], net, tok)
    assert sum(counts.values()) == pytest.approx(len(answer), rel=1e-5)  # one distribution per answer token
    with torch.no_grad():
        hidden, _ = net.forward_dense(torch.tensor([prompt + answer]))
        probs = net.logits(hidden[0, len(prompt) - 1 : -1], normed=True).softmax(-1).sum(0)
    top = int(probs.argmax())
    assert counts.most_common(1)[0][0] == top and counts[top] == pytest.approx(float(probs[top]), rel=1e-5)
    text = expected_counts([{"text": "def add(a, b): return a + b"}], net, tok)
    assert sum(text.values()) == pytest.approx(len(tok.encode("def add(a, b): return a + b")) - 1, rel=1e-5)


def test_a_drafter_ships_its_draft_vocabulary(tmp_path, qwen3_dir):
    """`serve_vocab` in a drafter's config is the draft vocabulary used when the caller names none
    (where the model has token counts); an explicit size, 0 included, overrides it."""
    from dspark.drafters.vocab import FILE

    model = tmp_path / "model"
    shutil.copytree(qwen3_dir, model)
    net, tok = load_model(model)
    d = new_drafter(new_config("dspark", net.config, tok.token_id("<|mask|>") or 0, serve_vocab=16))
    save_drafter(d, d.config, tmp_path / "drafter")
    # no token counts: the default falls back to every token
    assert build_engine(model, str(tmp_path / "drafter"), "static:3", profile="off").drafter.vocab_ids is None
    (model / FILE).write_text(json.dumps({"source": "test", "kind": "sampled", "total": 64,
                                          "ids": list(range(64)), "counts": [1] * 64}))
    engine = build_engine(model, str(tmp_path / "drafter"), "static:3", profile="off")
    assert engine.drafter.vocab_ids.tolist() == list(range(16))
    assert build_engine(model, str(tmp_path / "drafter"), "static:3", profile="off", draft_vocab=0).drafter.vocab_ids is None
    assert len(build_engine(model, str(tmp_path / "drafter"), "static:3", profile="off",
                            draft_vocab=32).drafter.vocab_ids) == 32
    # routed to the suffix drafter (`auto` is dspark+suffix) its neural part keeps the set it ships with, as alone
    routed = build_engine(model, f"{tmp_path / 'drafter'}+suffix", "static:3", profile="off").drafter
    assert routed.neural.vocab_ids.tolist() == list(range(16))
    assert build_engine(model, f"{tmp_path / 'drafter'}+suffix", "static:3", profile="off",
                        draft_vocab=0).drafter.neural.vocab_ids is None


@pytest.mark.parametrize("policy", ["static:7", "dspark"])
def test_greedy_output_unchanged_when_a_router_drafts_from_a_draft_vocabulary(qwen3_dir, plain, policy):
    from tests.test_route import routed

    engine = routed(qwen3_dir, policy)
    engine.drafter.restrict_vocab(list(range(0, engine.model.config.vocab_size, 2)))  # half the tokens
    assert engine.drafter.neural.vocab_ids is not None and engine.drafter.splits_vocab
    assert [o.token_ids for o in run(engine, PROMPTS[::3], GREEDY)] == plain, policy


def test_the_profile_times_a_split_vocabulary_both_ways(tmp_path, qwen3_dir, monkeypatch):
    """A drafter that drafts greedy batches over a draft vocabulary and sampled ones over every token has
    both proposals timed (`sampled_s` beside `draft_s`); one drafting over every token has one curve."""
    from dspark.engine.profiler import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "profiles"))
    model = tmp_path / "model"
    shutil.copytree(qwen3_dir, model)
    net, tok = load_model(model)
    vocab = net.config.vocab_size
    write_counts(model, Counter({t: vocab - t for t in range(vocab)}), "test")
    d = new_drafter(new_config("dspark", net.config, tok.token_id("<|mask|>") or 0))
    save_drafter(d, d.config, tmp_path / "drafter")
    cfg = EngineConfig(device="cpu", max_num_seqs=2, max_num_batched_tokens=24)
    split = build_engine(model, str(tmp_path / "drafter"), "dspark", cfg, draft_vocab=16).runner.profile
    assert len(split.sampled_s) == len(split.requests) == len(split.draft_s)
    whole = build_engine(model, str(tmp_path / "drafter"), "dspark", cfg, draft_vocab=0).runner.profile
    assert whole.sampled_s == [] and whole.key != split.key


def test_a_held_vocabulary_overrides_the_rows_choice(qwen3_dir):
    """The profile times the draft vocabulary's proposal with sampling rows: held narrow, a sampling batch
    drafts inside the set; released, it drafts over every token again."""
    engine = engine_for(qwen3_dir, "dspark", "static:7", None)
    drafter, vocab = engine.drafter, engine.model.config.vocab_size
    subset = list(range(1, vocab, 3))
    drafter.restrict_vocab(subset)
    sampled = SamplingRows.same(1, SamplingParams(temperature=1.0))
    with drafter.hold_vocab(narrow=True):
        block = propose(drafter, sampled)
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[subset] = False
    assert set(block.tokens.flatten().tolist()) <= set(subset) and float(block.probs[..., outside].abs().max()) == 0.0
    drafter.pool.free("r")
    assert drafter.held is None and float(propose(drafter, sampled).probs[..., outside].sum(-1).min()) > 0.0


def test_the_greedy_walk_on_the_host_drafts_what_torch_operations_draft():
    """The markov walk of a greedy block: NumPy on CPU, torch operations elsewhere; the same positions,
    ties included (the first maximum), and each against the step-by-step definition."""
    from dspark.drafters.tables import device_walk, host_walk

    gen = torch.Generator().manual_seed(3)
    base = torch.randn(3, 7, 50, generator=gen).round()  # rounded: ties between positions are common
    table = torch.randn(50, 50, generator=gen).round()
    first = torch.tensor([0, 17, 49])
    expected, index = [], first
    for k in range(7):
        index = torch.stack([(base[r, k] + table[index[r]]).argmax() for r in range(3)])
        expected.append(index)
    assert torch.equal(host_walk(base, table, first), torch.stack(expected, 1))
    assert torch.equal(device_walk(base, table, first), torch.stack(expected, 1))
    assert host_walk(base[:, :0], table, first).shape == device_walk(base[:, :0], table, first).shape == (3, 0)


def test_a_block_after_an_anchor_outside_the_draft_vocabulary_drafts_as_the_head_product_does(qwen3_dir):
    """The first bias is read from the table only when it holds the anchor; else the head's product."""
    engine = engine_for(qwen3_dir, "dspark", "static:7", None)
    drafter = engine.drafter
    with torch.no_grad():
        drafter.head.w2.weight.normal_(std=2.0, generator=torch.Generator().manual_seed(0))
    drafter.restrict_vocab(list(range(1, drafter.config.vocab_size, 2)))  # anchor 5 in it, 4 not
    rows = SamplingRows.same(1, SamplingParams(temperature=0.0))
    blocks = {}
    for use_table in (True, False):
        if not use_table:
            drafter.head.table = None
        for anchor in (4, 5):
            inputs = [ProposeInput("r", anchor=anchor, context_len=0, tokens=[anchor])]
            drafter.pool.append("r", 0)
            blocks[use_table, anchor] = drafter.propose(inputs, rows)
            drafter.pool.free("r")
    for anchor in (4, 5):
        assert torch.equal(blocks[True, anchor].tokens, blocks[False, anchor].tokens)
    assert not torch.equal(blocks[True, 4].tokens, blocks[True, 5].tokens)  # the anchor's bias moved the draft

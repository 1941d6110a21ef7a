"""The suffix drafter: its incremental index equals one rebuilt from scratch, it copies from the
request's own context and from finished requests (a bounded store), its confidences follow match
statistics and outcomes, it never rescans a request's history, and the engine's greedy output
with it is plain decoding's."""

from __future__ import annotations

import torch

from dspark.drafters.base import ContextRow, DrafterConfig, ProposeInput
from dspark.drafters.suffix import Calibration, Store, SuffixDrafter, count
from dspark.sampling import SamplingParams, SamplingRows

V = 50


def drafter(**kw) -> SuffixDrafter:
    return SuffixDrafter(DrafterConfig(kind="suffix", gamma=5, vocab_size=V, head="none", confidence=False,
                                       num_layers=0, **kw))


def rebuilt(tokens: list[int], depth: int) -> dict:
    index: dict = {}
    for i in range(1, len(tokens)):
        count(index, tokens, i, depth)
    return index


def feed(d: SuffixDrafter, sid: str, tokens: list[int], chunks: int = 1) -> None:
    step = -(-len(tokens) // chunks)
    for s in range(0, len(tokens), step):
        d.extend([ContextRow(sid, s, tokens[s : s + step], None)])


def propose(d: SuffixDrafter, sid: str, history: list[int], anchor: int):
    rows = SamplingRows.same(1, SamplingParams(temperature=0.0))
    return d.propose([ProposeInput(sid, anchor, len(history), history)], rows)


class NoReads(list):
    """A history that fails when read: proposals must come from the incremental index."""

    def __getitem__(self, item):
        raise AssertionError("the suffix drafter rescanned the request's history")

    def __iter__(self):
        raise AssertionError("the suffix drafter rescanned the request's history")


def test_incremental_index_equals_a_rebuild():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (120,), generator=gen).tolist()
    d = drafter()
    feed(d, "a", tokens, chunks=7)
    assert d.seqs["a"].index == rebuilt(tokens, d.config.suffix_depth)


def test_copies_the_continuation_of_the_longest_match_without_rescanning():
    span = [7, 8, 9, 10, 11, 12, 13, 14]
    history = [1, 2, *span, 3, 4, 7, 8, 9]
    d = drafter()
    feed(d, "a", history, chunks=3)
    block = propose(d, "a", NoReads(history), anchor=10)
    assert block.num_valid == [5]
    assert block.tokens[0].tolist() == [11, 12, 13, 14, 3]
    assert block.probs is None  # each copied token is certain
    probs = block.distributions(64)
    assert torch.equal(probs.argmax(-1), block.tokens) and bool((probs.sum(-1) == 1).all())
    conf = block.confidence[0].tolist()
    assert all(0 < c < 1 for c in conf)


def test_no_match_proposes_nothing():
    d = drafter()
    feed(d, "a", [1, 2, 3, 4])
    assert propose(d, "a", [1, 2, 3, 4], anchor=40).num_valid == [0]


def test_finished_requests_feed_the_store_and_the_store_is_bounded():
    d = drafter(suffix_store=30)
    first = [20, 21, 22, 23, 24, 25, 26, 27, 28]
    feed(d, "a", first)
    d.free("a")
    feed(d, "b", [5, 6, 20, 21])  # a new request that starts the same span
    assert propose(d, "b", [5, 6, 20, 21], anchor=22).tokens[0].tolist() == [23, 24, 25, 26, 27]
    for k in range(5):  # more finished requests push the first one out
        feed(d, f"x{k}", [30 + k] * 10)
        d.free(f"x{k}")
    assert d.store.size <= 30
    kept = Store(30, d.config.suffix_depth)
    for doc in d.store.docs:
        kept.add(doc)
    assert d.store.index == kept.index  # the evicted counts were taken back exactly
    assert propose(d, "b", [5, 6, 20, 21], anchor=22).num_valid == [0]


def test_forget_empties_the_store_and_keeps_live_requests():
    d = drafter()
    feed(d, "a", [20, 21, 22, 23, 24, 25])
    d.free("a")
    feed(d, "b", [5, 6, 20, 21])
    assert propose(d, "b", [5, 6, 20, 21], anchor=22).num_valid != [0]  # copied from "a"
    d.forget()
    assert d.store.size == 0 and not d.store.index and "b" in d.seqs
    assert propose(d, "b", [5, 6, 20, 21], anchor=22).num_valid == [0]


def test_profile_measurements_do_not_enter_the_store():
    d = drafter()
    propose(d, "__profile0", [1] * 40, anchor=1)  # history given, never extended: a throw-away context
    d.free("__profile0")
    assert d.store.size == 0


def test_confidence_grows_with_match_frequency_and_learns_from_outcomes():
    fresh = Calibration()
    assert fresh.confidence(fresh.bucket(4, 9, 9), 9, 9, 4) > fresh.confidence(fresh.bucket(4, 1, 1), 1, 1, 4)
    assert fresh.confidence(fresh.bucket(8, 1, 1), 1, 1, 8) > fresh.confidence(fresh.bucket(1, 1, 1), 1, 1, 1)
    d = drafter()
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    feed(d, "a", history)
    block = propose(d, "a", history, anchor=3)  # drafts 4, 5, ... (a single earlier occurrence)
    before = block.confidence[0, 0].item()
    bucket = d.seqs["a"].proposal[2][0]
    d.extend([ContextRow("a", 9, [3, 40], None)])  # the target committed 3, then 40, not 4
    propose(d, "a", [*history, 3, 40], anchor=41)
    assert d.calibration.table[bucket] == [0.0, 1.0]  # judged once, wrong; nothing judged past it
    assert d.calibration.confidence(bucket, 1, 1, 1) < before  # a one-token match ("3")


def test_greedy_identical_to_plain_decoding(qwen3_dir):
    from tests.test_spec_engine import PROMPTS, engine_for, run

    reference = [o.token_ids for o in run(engine_for(qwen3_dir), PROMPTS[::3])]
    for policy in ("static:7", "dspark"):
        engine = engine_for(qwen3_dir, "suffix", policy)
        outs = run(engine, PROMPTS[::3])
        assert [o.token_ids for o in outs] == reference, policy
        assert sum(o.stats["accepted_tokens_by"].get("suffix", 0) for o in outs) > 0
        assert engine.kv.pool.num_used_blocks == 0 and not engine.drafter.seqs

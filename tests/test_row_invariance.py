"""A row's logits do not depend on how many rows share its forward, in float32 and bfloat16.

Speculative greedy output equals plain greedy output only if verifying [x, d_1..d_l] gives
row x exactly what a plain one-token step gives it. In bfloat16 a fused attention kernel
blocks its work by the number of queries, and its rounding differences, amplified by
bfloat16 activations over the layers, flipped greedy tokens on the shipped model; short
queries are therefore computed as plain matrix products over tiles of query rows (`models/attention.py`).
"""

from __future__ import annotations

import pytest
import torch

from dspark.engine.batch import BatchRow
from dspark.models import decoder
from dspark.models.attention import FUSED_REQUESTS, AttentionMetadata, fuses, group_attention
from tests.test_spec_engine import PROMPTS, engine_for, run


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_verify_row_gets_what_a_plain_step_gets(qwen3_dir, dtype):
    engine = engine_for(qwen3_dir, dtype=dtype, num_kv_blocks=64)
    runner, pool = engine.runner, engine.kv.pool
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, engine.model.config.vocab_size, (64,), generator=gen).tolist()
    tol = 0.0 if dtype == "bfloat16" else 1e-4  # float32 kernels differ by rounding only; bfloat16 must be exact
    with torch.inference_mode():
        for c in range(20, 44):  # every offset into a 4-token KV block, and a block boundary crossed or not
            sid = f"s{c}"
            pool.append(sid, c + 8)
            runner.target_forward([BatchRow(sid, ids[:c], c, 1)])
            _, one = runner.target_forward([BatchRow(sid, [ids[c]], c + 1, 1)])
            _, eight = runner.target_forward([BatchRow(sid, ids[c:c + 8], c + 8, 8)])
            assert (one.logits[0] - eight.logits[0]).abs().max().item() <= tol, c
            pool.free(sid)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_lone_request_read_in_place_gets_what_a_gathered_one_gets(qwen3_dir, dtype):
    """One request whose context blocks are consecutive is attended in place (a view of the cache);
    beside another request its context is gathered. Its logits are the same either way, exactly."""
    engine = engine_for(qwen3_dir, dtype=dtype, num_kv_blocks=64)
    runner, pool = engine.runner, engine.kv.pool
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, engine.model.config.vocab_size, (80,), generator=gen).tolist()
    with torch.inference_mode():
        for sid, n in (("a", 41), ("b", 30)):
            pool.append(sid, n + 8)
            runner.target_forward([BatchRow(sid, ids[:n], n, 1)])
        table = pool.block_table("a")
        assert table == list(range(table[0], table[0] + len(table)))  # the first request: consecutive blocks
        lone = AttentionMetadata.build([8], [49], [table], pool.block_size, "cpu")
        pair = AttentionMetadata.build([8, 8], [49, 38], [table, pool.block_table("b")], pool.block_size, "cpu")
        assert lone.groups[0].first_block == table[0] and pair.groups[0].first_block is None
        _, alone = runner.target_forward([BatchRow("a", ids[41:49], 49, 8)])
        _, both = runner.target_forward([BatchRow("a", ids[41:49], 49, 8), BatchRow("b", ids[30:38], 38, 8)])
    assert torch.equal(alone.logits, both.logits[:8])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_one_token_row_padded_into_the_verify_grid_gets_what_its_own_grid_gives(qwen3_dir, dtype):
    """One-token rows share the verify rows' grid while their padding is small (`PAD_ROWS`): their logits are
    what they get in a grid of their own, exactly in bfloat16."""
    engine = engine_for(qwen3_dir, dtype=dtype, num_kv_blocks=64)
    runner, pool = engine.runner, engine.kv.pool
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, engine.model.config.vocab_size, (80,), generator=gen).tolist()
    tol = 0.0 if dtype == "bfloat16" else 1e-4
    with torch.inference_mode():
        for sid, n in (("a", 37), ("b", 30)):
            pool.append(sid, n + 8)
            runner.target_forward([BatchRow(sid, ids[:n], n, 1)])
        decode, verify = BatchRow("a", [ids[37]], 38, 1), BatchRow("b", ids[30:38], 38, 8)
        shared = AttentionMetadata.build([1, 8], [38, 38], [pool.block_table("a"), pool.block_table("b")],
                                         pool.block_size, "cpu")
        assert len(shared.groups) == 1  # one grid: 1 x 7 padded query rows
        _, alone = runner.target_forward([decode])
        _, both = runner.target_forward([decode, verify])
    assert (alone.logits[0] - both.logits[0]).abs().max().item() <= tol


def test_a_verify_row_attends_exactly_as_its_plain_step_at_every_context():
    """Row i of an 8-token verify grid (context c + 8) against the plain step of its position (context c + i + 1),
    for every context up to 300 with 16-token blocks: the grids' widths differ by up to a block, and the masked keys
    past a row's context must not change its bfloat16 sum over the keys (`grid_blocks`). On an AMX CPU a grid of
    112 keys summed differently from one of 96 and flipped greedy tokens of dspark-small; 32 query heads of 64
    dimensions make such a rounding difference likely to show."""
    gen = torch.Generator().manual_seed(3)
    kv_heads, heads, dim, bs, n = 8, 32, 64, 16, 8
    slots = 320 + n + bs
    k_cache, v_cache = (torch.randn(kv_heads, slots, dim, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(slots, heads, dim, generator=gen).bfloat16()
    table = list(range(slots // bs))
    for c in range(1, 300):
        verify = AttentionMetadata.build([n], [c + n], [table], bs, "cpu").groups[0]
        rows = group_attention(q[c : c + n], k_cache, v_cache, verify, bs)
        for i in range(n):
            plain = AttentionMetadata.build([1], [c + i + 1], [table], bs, "cpu").groups[0]
            assert torch.equal(group_attention(q[c + i : c + i + 1], k_cache, v_cache, plain, bs)[0], rows[i]), (c, i)


def test_an_engine_runs_one_scratch_forward_once_built_and_keeps_none_of_it(qwen3_dir, monkeypatch):
    """`ModelRunner.warm`: a request's forward is never the process's first (on an AMX CPU the first could round
    otherwise than every later one); the scratch sequence's cache is freed before any request runs."""
    from dspark.engine.runner import WARM_ID, ModelRunner

    seen, forward = [], ModelRunner.target_forward

    def counted(self, rows, taps=()):
        seen.append([r.seq_id for r in rows])
        return forward(self, rows, taps)

    monkeypatch.setattr(ModelRunner, "target_forward", counted)
    engine = engine_for(qwen3_dir, "dspark", "static:7")
    assert seen == [[WARM_ID]]
    assert engine.kv.pool.num_used_blocks == 0
    run(engine, PROMPTS[:2])
    assert all(WARM_ID not in ids for ids in seen[1:]) and len(seen) > 1


@pytest.mark.parametrize("kind", ["dspark", "eagle3", "mtp"])
def test_the_targets_attention_stays_row_invariant_and_a_drafters_may_fuse(qwen3_dir, monkeypatch, kind):
    """Every attention over the target's cache reads invariant metadata (each row computed as it is alone: the
    lossless guarantee rests on it); every attention over a neural drafter's cache reads metadata that lets
    bfloat16 attention run as one fused kernel (a proposal only decides what the target verifies)."""
    seen: list[tuple[int, bool]] = []
    real = decoder.paged_attention

    def spy(q, k, v, k_cache, v_cache, meta):
        seen.append((k_cache.data_ptr(), meta.invariant))
        return real(q, k, v, k_cache, v_cache, meta)

    monkeypatch.setattr(decoder, "paged_attention", spy)
    engine = engine_for(qwen3_dir, kind, "static:3", dtype="bfloat16")
    run(engine, PROMPTS[:2])
    target = {kc.data_ptr() for kc, _ in engine.kv.layers}
    drafter = {kc.data_ptr() for kc, _ in engine.drafter.cache.layers}
    assert {inv for ptr, inv in seen if ptr in target} == {True}
    assert {inv for ptr, inv in seen if ptr in drafter} == {False}
    assert all(ptr in target | drafter for ptr, _ in seen)


def test_fused_attention_gives_what_the_written_out_products_give_up_to_rounding():
    """A drafter's fused attention (invariant=False) against the written-out one, bfloat16, over grids with
    padded query rows and a causal block: the same up to bfloat16 rounding, and no NaN in a padded row."""
    gen = torch.Generator().manual_seed(5)
    kv_heads, heads, dim, bs = 2, 4, 64, 16
    k_cache, v_cache = (torch.randn(kv_heads, 512, dim, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(40, heads, dim, generator=gen).bfloat16()
    tables = [list(range(0, 16)), list(range(16, 32))]
    meta = AttentionMetadata.build([7, 3], [100, 203], tables, bs, "cpu", invariant=False)
    assert not meta.invariant
    for group in meta.groups:
        exact = group_attention(q, k_cache, v_cache, group, bs)
        fused = group_attention(q, k_cache, v_cache, group, bs, invariant=False)
        assert torch.isfinite(fused.float()).all()
        assert (exact.float() - fused.float()).abs().max().item() < 3e-2


def test_a_drafters_attention_over_many_requests_stays_written_out_on_cpu():
    """Over more than FUSED_REQUESTS requests the fused kernel ran slower on CPU than the written-out products
    (`attention.fuses`): a drafter's attention there is the written-out one, bit for bit."""
    gen = torch.Generator().manual_seed(6)
    kv_heads, heads, dim, bs, n = 2, 4, 64, 16, FUSED_REQUESTS + 4
    k_cache, v_cache = (torch.randn(kv_heads, 16 * 4 * n, dim, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(n, heads, dim, generator=gen).bfloat16()
    tables = [list(range(4 * r, 4 * r + 4)) for r in range(n)]
    exact = AttentionMetadata.build([1] * n, [30 + r for r in range(n)], tables, bs, "cpu").groups[0]
    drafter = AttentionMetadata.build([1] * n, [30 + r for r in range(n)], tables, bs, "cpu", invariant=False).groups[0]
    assert torch.equal(group_attention(q, k_cache, v_cache, exact, bs),
                       group_attention(q, k_cache, v_cache, drafter, bs, invariant=False))
    assert fuses(torch.zeros(kv_heads, FUSED_REQUESTS, 1, dim)) and not fuses(torch.zeros(kv_heads, n, 1, dim))

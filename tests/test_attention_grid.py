"""The attention grids of `AttentionMetadata.build` hold what their fields say, element by element.

Each group pads some requests' queries to one grid; a query of request r at position p sees key j of
its context when j < context_len (and j <= p when causal), a padded query sees key 0 at least, and the
index fields name the flat rows and cache blocks in order; a grid's keys are a multiple of
`KEY_MULTIPLE` (the width a row's sum over its keys is the same for). Checked on seeded random layouts (decode
rows, verify rows, prefill chunks, several requests, causal or not) against that definition, one
element at a time.
"""

from __future__ import annotations

import random

import pytest

from dspark.models.attention import KEY_MULTIPLE, AttentionMetadata
from dspark.models.buckets import bucket


def random_layout(rng: random.Random):
    block_size = rng.choice([4, 16])
    n = rng.randint(1, 6)
    query_lens = [rng.choice([1, 1, 2, 8, rng.randint(1, 40)]) for _ in range(n)]
    context_lens = [q + rng.randint(0, 300) for q in query_lens]
    tables = [rng.sample(range(200), -(-c // block_size) + rng.randint(0, 3)) for c in context_lens]
    return query_lens, context_lens, tables, block_size


def check_group(group, members, query_lens, context_lens, tables, starts, block_size, causal) -> None:
    num_q = max(query_lens[r] for r in members)
    shaped = bucket(-(-max(context_lens[r] for r in members) // block_size))  # whole blocks, a recurring size
    per = next(n for n in range(1, KEY_MULTIPLE + 1) if n * block_size % KEY_MULTIPLE == 0)
    width = -(-shaped // per) * per  # the fewest blocks from there whose keys are a multiple of KEY_MULTIPLE
    assert tuple(group.mask.shape) == (len(members), 1, num_q, width * block_size)
    mask = group.mask[:, 0].tolist()
    valid_rows = []
    for g, r in enumerate(members):
        q, c = query_lens[r], context_lens[r]
        for i in range(num_q):
            expected_index = starts[r] + i if i < q else 0
            assert group.query_index[g, i].item() == expected_index
            if i < q:
                valid_rows.append(g * num_q + i)
            if i >= q:  # a padded query: its output is dropped; it sees key 0 at least, so its softmax has no NaN
                assert mask[g][i][0], (r, i)
                continue
            for j in range(width * block_size):
                assert mask[g][i][j] == (j < c and (not causal or j <= c - q + i)), (r, i, j)
        row = list(tables[r][:width])
        assert group.kv_blocks[g].tolist() == row + [0] * (width - len(row))
    assert group.query_rows.tolist() == valid_rows


@pytest.mark.parametrize("seed", range(12))
def test_every_grid_element_follows_the_definition(seed):
    rng = random.Random(seed)
    query_lens, context_lens, tables, block_size = random_layout(rng)
    causal = seed % 3 != 0
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size, "cpu", causal=causal)
    starts = [sum(query_lens[:r]) for r in range(len(query_lens))]
    flat = []
    for group in meta.groups:
        members = [starts.index(first) for first in group.query_index[:, 0].tolist()]  # a request's first query is
        # its start, distinct for every request (each has a new token)
        check_group(group, members, query_lens, context_lens, tables, starts, block_size, causal)
        flat += [starts[r] + i for r in members for i in range(query_lens[r])]
    assert sorted(flat) == list(range(sum(query_lens)))  # every flat token in exactly one grid
    positions = [c - q + i for q, c in zip(query_lens, context_lens, strict=True) for i in range(q)]
    assert meta.positions.tolist() == positions


def test_one_token_rows_share_the_verify_grid_while_their_padding_is_small():
    from dspark.config import PAD_ROWS

    def grids(decode: int, verify: list[int], pad_rows: int = PAD_ROWS) -> list[int]:
        qlens = [1] * decode + verify
        tables = [[3 * r, 3 * r + 1, 3 * r + 2] for r in range(len(qlens))]
        meta = AttentionMetadata.build(qlens, [48] * len(qlens), tables, 16, "cpu", pad_rows=pad_rows)
        return [g.query_index.shape[0] for g in meta.groups]

    assert grids(PAD_ROWS // 7, [8]) == [PAD_ROWS // 7 + 1]  # padded to 8 queries: 7 rows each, within the bound
    assert grids(PAD_ROWS // 7 + 1, [8]) == [PAD_ROWS // 7 + 1, 1]  # past it: their own grid, listed first
    assert grids(PAD_ROWS, [2, 2]) == [PAD_ROWS + 2]  # one query row of padding each
    assert grids(3, []) == [3] and grids(0, [8, 2]) == [2]
    assert grids(2, [8, 40]) == [3, 1]  # a prefill chunk keeps its own grid
    assert grids(1, [2], pad_rows=0) == [1, 1] and grids(1, [2], pad_rows=1) == [2]  # the engine's setting


def test_the_engine_hands_its_padding_bound_to_every_forward(qwen3_dir):
    from dspark.config import EngineConfig
    from dspark.engine.factory import build_engine

    engine = build_engine(str(qwen3_dir), None, "none", EngineConfig(device="cpu", pad_rows=0))
    assert engine.runner.pad_rows == 0
    with pytest.raises(ValueError, match="pad_rows"):
        EngineConfig(device="cpu", pad_rows=-1)

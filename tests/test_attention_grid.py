"""The attention grids of `AttentionMetadata.build` hold what their fields say, element by element.

Each group pads some requests' queries to one grid; a query of request r at position p sees key j of
its context when j < context_len (and j <= p when causal), a padded query sees key 0 at least, and the
index fields name the flat rows and cache blocks in order. Checked on seeded random layouts (decode
rows, verify rows, prefill chunks, several requests, causal or not) against that definition, one
element at a time.
"""

from __future__ import annotations

import random

import pytest

from dspark.models.attention import AttentionMetadata
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
    width = bucket(-(-max(context_lens[r] for r in members) // block_size))
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

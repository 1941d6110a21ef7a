"""Property tests of the paged KV pool: no leaks, no sharing, truncate-then-append."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.kv_cache import BlockPool, OutOfBlocks

ops = st.lists(
    st.tuples(st.sampled_from(["append", "truncate", "free"]), st.integers(0, 4), st.integers(0, 20)),
    max_size=60,
)


def check_invariants(pool: BlockPool) -> None:
    live = [b for t in pool.tables.values() for b in t]
    assert len(live) == len(set(live)), "a block is shared by two requests"
    assert len(live) + pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    assert not set(live) & set(pool._free), "a live block is also free"
    for seq, table in pool.tables.items():
        assert len(table) == pool.blocks_needed(pool.lengths[seq])


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(1, 8), st.integers(1, 30))
def test_random_operations_keep_invariants(operations, block_size, num_blocks):
    pool = BlockPool(num_blocks, block_size)
    for op, seq, n in operations:
        if op == "append":
            before = (dict(pool.lengths), pool.num_free_blocks)
            try:
                pool.append(seq, n)
            except OutOfBlocks:
                assert (dict(pool.lengths), pool.num_free_blocks) == before  # all-or-nothing
        elif op == "truncate":
            pool.truncate(seq, min(n, pool.length(seq)))
        else:
            pool.free(seq)
        check_invariants(pool)
    for seq in list(pool.tables):
        pool.free(seq)
    assert pool.num_free_blocks == num_blocks


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(0, 40), st.integers(0, 40), st.integers(0, 40))
def test_truncate_then_append_equals_never_appended(block_size, base, extra, later):
    a, b = BlockPool(256, block_size), BlockPool(256, block_size)
    a.append("r", base + extra)
    a.truncate("r", base)
    a.append("r", later)
    b.append("r", base)
    b.append("r", later)
    assert a.length("r") == b.length("r") == base + later
    assert len(a.block_table("r")) == len(b.block_table("r"))
    assert a.num_free_blocks == b.num_free_blocks
    # the first blocks (holding the kept prefix) are unchanged by the rollback
    kept = a.blocks_needed(base)
    c = BlockPool(256, block_size)
    c.append("r", base + extra)
    assert a.block_table("r")[:kept] == c.block_table("r")[:kept]


def test_freed_blocks_are_taken_back_first_and_in_order():
    """A rollback and a regrowth take the same blocks back (a speculative step, a proposal's temporary
    slots), and a freed request's blocks go to the next request in their order: contexts stay in
    consecutive blocks where they can, which attention reads in place."""
    pool = BlockPool(16, 4)
    pool.append("a", 5)
    pool.append("b", 3)
    pool.append("a", 8)
    grown = list(pool.block_table("a"))
    for _ in range(3):
        pool.truncate("a", 5)
        pool.append("a", 8)
        assert pool.block_table("a") == grown
    pool.free("a")
    pool.append("c", 13)
    assert pool.block_table("c") == grown

"""The mlp sequential head served from tables over a draft vocabulary (`dspark/drafters/tables.py`): its tables give
the bias its own step gives, greedy and sampled blocks are the ones the head's products draft, the NumPy walk draws
what the torch walk draws, and greedy output through the engine stays plain decoding's."""

from __future__ import annotations

import pytest
import torch

from dspark.config import EngineConfig
from dspark.drafters.base import ProposeInput
from dspark.drafters.registry import new_config, new_drafter
from dspark.drafters.tables import Mix, device_walk, host_walk
from dspark.engine.factory import assemble
from dspark.models.loader import load_model
from dspark.sampling import SamplingParams, SamplingRows
from tests.test_spec_engine import PROMPTS, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def mlp_engine(path, policy: str = "static:7", restrict: bool = True):
    """An engine whose DSpark drafter has an mlp head that moves the logits (so a wrong table changes the draft),
    drafting over the odd token ids."""
    net, tok = load_model(path)
    torch.manual_seed(0)
    drafter = new_drafter(new_config("dspark", net.config, tok.token_id("<|mask|>") or 0, head="mlp"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        drafter.head.w2.weight.normal_(std=2.0, generator=gen)
        drafter.head.mix_out.weight.normal_(std=0.5, generator=gen)
    engine = assemble(net, tok, EngineConfig(device="cpu", block_size=4, max_num_batched_tokens=96),
                      drafter=drafter, policy=policy)
    if restrict:
        drafter.restrict_vocab(list(range(1, net.config.vocab_size, 2)))
    return engine


def propose(drafter, rows, anchor: int = 5):
    inputs = [ProposeInput("r", anchor=anchor, context_len=0, tokens=[anchor],
                           generator=torch.Generator().manual_seed(1))]
    drafter.pool.append("r", 0)
    try:
        return drafter.propose(inputs, rows)
    finally:
        drafter.pool.free("r")


def test_the_tables_give_the_bias_the_head_step_gives(qwen3_dir):
    drafter = mlp_engine(qwen3_dir).drafter
    head = drafter.head
    assert head.table is not None and isinstance(head.mix, Mix)
    n, d = len(drafter.vocab_ids), drafter.config.hidden_size
    assert head.mix.entry.shape == (n, d) and head.mix.exit.shape == (d, n)
    rows = torch.tensor([0, 3, n - 1])
    h = torch.randn(3, d, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        stepped, _, _ = head.step(h, drafter.vocab_ids[rows], None)
        tabled = head.table[rows] + head.mix.bias(head.mix.start(h[:, None])[:, 0], rows)
    assert stepped.shape == tabled.shape == (3, n)
    assert torch.allclose(stepped.float(), tabled, atol=1e-4)
    correction = head.mix.bias(head.mix.start(h[:, None])[:, 0], rows)
    assert float(correction.abs().max()) > 0.1  # the correction moves the bias: the comparison above can fail


@pytest.mark.parametrize("anchor", [5, 4])  # 5 is in the draft vocabulary (its row starts the walk), 4 is not
def test_greedy_blocks_from_tables_are_the_head_products_blocks(qwen3_dir, anchor):
    drafter = mlp_engine(qwen3_dir).drafter
    head, rows = drafter.head, SamplingRows.same(1, SamplingParams(temperature=0.0))
    tabled = propose(drafter, rows, anchor)
    mix = head.mix
    head.mix = None  # the markov table alone: a walk without the correction drafts another block
    assert not torch.equal(propose(drafter, rows, anchor).tokens, tabled.tokens)
    head.table = None  # the head's own step at every position
    stepped = propose(drafter, rows, anchor)
    assert mix is not None and torch.equal(tabled.tokens, stepped.tokens)
    assert torch.allclose(tabled.confidence, stepped.confidence, atol=1e-6)


def test_sampled_blocks_over_the_draft_vocabulary_from_tables_are_the_head_products(qwen3_dir):
    drafter = mlp_engine(qwen3_dir).drafter
    rows = SamplingRows.same(1, SamplingParams(temperature=1.0))
    with drafter.hold_vocab(narrow=True):
        tabled = propose(drafter, rows)
        drafter.head.table, drafter.head.mix = None, None
        stepped = propose(drafter, rows)
    assert torch.equal(tabled.tokens, stepped.tokens)
    assert torch.allclose(tabled.probs, stepped.probs, atol=1e-5)


def test_the_walk_on_the_host_draws_what_torch_operations_draw():
    """With a correction: NumPy on CPU, torch elsewhere, each against the position-by-position definition."""
    gen = torch.Generator().manual_seed(4)
    n, d, r, depth = 40, 16, 3, 6
    mix = Mix(torch.randn(n, d, generator=gen), torch.randn(d, d, generator=gen), torch.randn(d, n, generator=gen))
    base, table = torch.randn(r, depth, n, generator=gen), torch.randn(n, n, generator=gen)
    start, first = mix.start(torch.randn(r, depth, d, generator=gen)), torch.tensor([0, 11, 39])
    expected, index = [], first
    for k in range(depth):
        pre = start[:, k] + mix.entry[index]
        index = (base[:, k] + table[index] + torch.nn.functional.silu(pre) @ mix.exit).argmax(-1)
        expected.append(index)
    assert torch.equal(host_walk(base, table, first, mix, start), torch.stack(expected, 1))
    assert torch.equal(device_walk(base, table, first, mix, start), torch.stack(expected, 1))
    without = host_walk(base, table, first)
    assert not torch.equal(without, torch.stack(expected, 1))  # the correction changed the walk


@pytest.mark.parametrize("policy", ["static:7", "dspark"])
def test_greedy_output_with_a_tabled_mlp_head_is_plain_decodings(qwen3_dir, policy):
    net, tok = load_model(qwen3_dir)
    plain = assemble(net, tok, EngineConfig(device="cpu", block_size=4, max_num_batched_tokens=96))
    expected = [o.token_ids for o in run(plain, PROMPTS[::3], GREEDY)]
    engine = mlp_engine(qwen3_dir, policy)
    assert [o.token_ids for o in run(engine, PROMPTS[::3], GREEDY)] == expected


def test_the_bias_over_every_token_on_cpu_is_w2s_and_follows_w2(qwen3_dir):
    """Over every token, serving on CPU reads W2 from a float32 copy, made again whenever W2 changes."""
    drafter = mlp_engine(qwen3_dir, restrict=False).drafter
    head = drafter.head
    e = head.w1(torch.tensor([3, 7, 11]))
    with torch.inference_mode():
        served = head.out(e)
    assert served.dtype == torch.float32 and served.shape == (3, drafter.config.vocab_size)
    assert torch.allclose(served, head.w2(e).float(), atol=1e-5)
    with torch.no_grad():
        head.w2.weight.mul_(-1.0)  # in place: the copy must be made again
    with torch.inference_mode():
        assert torch.allclose(head.out(e), -served, atol=1e-5)

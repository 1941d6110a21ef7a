"""Our runtime's logits equal transformers' (fp32) for prefill and for incremental decoding
of a mixed flat batch (requests at different lengths, paged KV)."""

from __future__ import annotations

import torch

from dspark.engine.batch import Batch, BatchRow
from dspark.kv_cache import PagedKVCache
from dspark.models.attention import SHORT_QUERY, query_bucket
from dspark.models.loader import load_model

TOL = 1e-5  # measured worst case 1.5e-6 (fp32, tiny random models)


def hf_logits(path, ids: list[int]) -> torch.Tensor:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_dense_prefill_matches_transformers(model_dir):
    net, tok = load_model(model_dir)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. def add(a, b):")
    with torch.no_grad():
        hidden, _ = net.forward_dense(torch.tensor([ids]))
        ours = net.logits(hidden, normed=True)[0]
    assert (ours - hf_logits(model_dir, ids)).abs().max().item() < TOL


def test_flat_paged_batch_matches_transformers(model_dir):
    """Three requests of different lengths: prefill chunks, then interleaved decode steps."""
    net, tok = load_model(model_dir)
    prompts = [tok.encode(t) for t in ("The quick brown fox", "def add(a, b):\n    return a + b", "Natalia")]
    conts = [[5, 17, 42, 7], [9, 3, 11, 60], [30, 31, 32, 33]]
    full = [p + c for p, c in zip(prompts, conts, strict=True)]
    refs = [hf_logits(model_dir, ids) for ids in full]
    kv = PagedKVCache(net.config, num_blocks=32, block_size=4, device="cpu", dtype=torch.float32)
    done = [0, 0, 0]
    # step 1: request 0 prefills in two chunks, 1 whole, 2 whole; later steps: 1-2 tokens each
    plans = [[3, len(prompts[1]), len(prompts[2])], [len(prompts[0]) - 3, 1, 2], [1, 2, 1], [2, 1, 1]]
    with torch.no_grad():
        for plan in plans:
            rows = []
            for r, n in enumerate(plan):
                kv.pool.append(str(r), n)
                rows.append(BatchRow(str(r), full[r][done[r] : done[r] + n], done[r] + n, n))
            batch = Batch.build(rows, kv.pool, "cpu")
            out = net(batch.input_ids, batch.meta, kv.layers, batch.logits_indices)
            for r, n in enumerate(plan):
                got = out.logits[batch.cu_logits[r] : batch.cu_logits[r + 1]]
                want = refs[r][done[r] : done[r] + n]
                assert (got - want).abs().max().item() < TOL, (r, plan)
                done[r] += n


def test_long_prefill_between_decodes_matches_transformers(model_dir):
    """A prefill chunk longer than SHORT_QUERY attends in its own group, between decode rows
    (the output is put back in flat order), and then decodes in the short group."""
    assert [query_bucket(q) for q in (1, 2, 16, 17, 32, 33, 960)] == [-1, 0, 0, 5, 5, 6, 10]
    net, tok = load_model(model_dir)
    short = [tok.encode("The quick brown fox"), tok.encode("Natalia sold clips")]
    long = tok.encode("def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n" * 2)
    assert len(long) > SHORT_QUERY + 4
    full = [short[0] + [5, 17, 42], long + [9, 3], short[1] + [30, 31, 32, 33]]
    refs = [hf_logits(model_dir, ids) for ids in full]
    kv = PagedKVCache(net.config, num_blocks=64, block_size=4, device="cpu", dtype=torch.float32)
    done = [0, 0, 0]
    plans = [[len(short[0]), 0, len(short[1])], [1, len(long) - 3, 2], [2, 3, 1], [0, 2, 1]]
    with torch.no_grad():
        for plan in plans:
            live = [r for r, n in enumerate(plan) if n]
            rows = []
            for r in live:
                kv.pool.append(str(r), plan[r])
                rows.append(BatchRow(str(r), full[r][done[r] : done[r] + plan[r]], done[r] + plan[r], plan[r]))
            batch = Batch.build(rows, kv.pool, "cpu")
            out = net(batch.input_ids, batch.meta, kv.layers, batch.logits_indices)
            for i, r in enumerate(live):
                got = out.logits[batch.cu_logits[i] : batch.cu_logits[i + 1]]
                want = refs[r][done[r] : done[r] + plan[r]]
                assert (got - want).abs().max().item() < TOL, (r, plan)
                done[r] += plan[r]


def test_truncate_then_continue_matches(qwen3_dir):
    """Rolling the cache back (rejected drafts) then feeding other tokens gives exact logits."""
    net, tok = load_model(qwen3_dir)
    prompt = tok.encode("The quick brown fox jumps")
    kv = PagedKVCache(net.config, num_blocks=16, block_size=4, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        kv.pool.append("a", len(prompt) + 5)
        rows = [BatchRow("a", prompt + [1, 2, 3, 4, 5], len(prompt) + 5, 1)]
        b = Batch.build(rows, kv.pool, "cpu")
        net(b.input_ids, b.meta, kv.layers, b.logits_indices)
        kv.pool.truncate("a", len(prompt) + 1)
        kv.pool.append("a", 2)
        b = Batch.build([BatchRow("a", [7, 8], len(prompt) + 3, 2)], kv.pool, "cpu")
        got = net(b.input_ids, b.meta, kv.layers, b.logits_indices).logits
    want = hf_logits(qwen3_dir, prompt + [1, 7, 8])[-2:]
    assert (got - want).abs().max().item() < TOL

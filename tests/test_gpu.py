"""CUDA checks (run where a GPU is available): the same code at bfloat16 on the GPU gives
greedy speculative output identical to greedy plain decoding."""

from __future__ import annotations

import pytest
import torch

from dspark.config import EngineConfig
from dspark.drafters.registry import new_config, new_drafter
from dspark.engine.factory import assemble
from dspark.models.loader import load_model
from dspark.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = ["Natalia sold clips", "def add(a, b):", "Explain list comprehensions"]


@pytest.mark.parametrize("kind,policy", [("dspark", "dspark"), ("ngram", "static:7"), ("eagle3", "dspark-async")])
def test_greedy_identity_bf16_cuda(qwen3_dir, kind, policy):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for drafter_kind, pol in ((None, "none"), (kind, policy)):
        net, tok = load_model(qwen3_dir, "cuda", "bfloat16")
        torch.manual_seed(0)
        drafter = new_drafter(new_config(drafter_kind, net.config, 5)) if drafter_kind else None
        engine = assemble(net, tok, EngineConfig(device="cuda", dtype="bfloat16"), drafter=drafter, policy=pol)
        reqs = [engine.add_request(p, params) for p in PROMPTS]
        outs.append([o.token_ids for o in engine.run_until_done(reqs)])
        assert engine.kv.pool.num_used_blocks == 0
    assert outs[0] == outs[1]

"""Reads of single values from tensors (`.item()`, `int(t)`, `bool(t)`: on a GPU each one waits
for the device) in an engine step. The step reads the device only in whole-batch copies
(`.tolist()` of the sampled tokens, the draft block, the verdict, the confidences): no single
values, whatever the number of requests, the drafter or the sampling settings. Sampling settings
are known on the host (`SamplingRows`), attention metadata is built from host lists, and
verification computes the residual for every row instead of asking whether any row was rejected.
On a host-bound GPU per-request reads made the speculative steps at 16 requests several times
slower than plain ones (docs/results/gpu-h200/README.md). Counted with the torch profiler on
CPU, where the same reads show as `aten::_local_scalar_dense`."""

from __future__ import annotations

import pytest
from torch.profiler import ProfilerActivity, profile

from dspark.sampling import SamplingParams
from tests.test_spec_engine import engine_for

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=12, ignore_eos=True)


def reads_per_step(path, kind: str | None, policy: str, num_requests: int, params=GREEDY) -> float:
    engine = engine_for(path, kind, policy, max_num_batched_tokens=512)
    reqs = [engine.add_request(f"def add(a, b):\n    return a + b  # {i}", params) for i in range(num_requests)]
    for _ in range(2):  # prefill, first decode
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            engine.step()
    counts = {e.key: e.count for e in prof.key_averages()}
    engine.run_until_done(reqs)
    return counts.get("aten::_local_scalar_dense", 0) / 4


@pytest.mark.parametrize("kind,policy", [("dspark", "static:7"), ("dspark", "dspark"), ("eagle3", "static:7"),
                                         ("ngram", "static:7"), (None, "none")])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_step_reads_no_single_values_from_the_device(qwen3_dir, kind, policy, params):
    assert reads_per_step(qwen3_dir, kind, policy, 2, params) == 0
    assert reads_per_step(qwen3_dir, kind, policy, 8, params) == 0

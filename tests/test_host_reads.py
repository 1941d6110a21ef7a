"""Reads of single values from tensors (`.item()`, `int(t)`, `bool(t)`: on a GPU each one waits
for the device) per engine step must not grow with the number of requests: the speculative
round reads the device once per batch, not once per request. On a host-bound GPU such
per-request reads made the speculative steps at 16 requests several times slower than plain
ones (docs/results/gpu-h200/README.md). Counted with the torch profiler on CPU, where the
same reads show as `aten::_local_scalar_dense`."""

from __future__ import annotations

import pytest
from torch.profiler import ProfilerActivity, profile

from dspark.sampling import SamplingParams
from tests.test_spec_engine import engine_for

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def reads_per_step(path, kind: str, policy: str, num_requests: int) -> float:
    engine = engine_for(path, kind, policy, max_num_batched_tokens=512)
    reqs = [engine.add_request(f"def add(a, b):\n    return a + b  # {i}", PARAMS) for i in range(num_requests)]
    for _ in range(2):  # prefill, first decode
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            engine.step()
    counts = {e.key: e.count for e in prof.key_averages()}
    engine.run_until_done(reqs)
    return counts.get("aten::_local_scalar_dense", 0) / 4


@pytest.mark.parametrize("kind,policy", [("dspark", "static:7"), ("eagle3", "static:7"), (None, "none")])
def test_single_value_reads_per_step_do_not_grow_with_requests(qwen3_dir, kind, policy):
    few = reads_per_step(qwen3_dir, kind, policy, 2)
    many = reads_per_step(qwen3_dir, kind, policy, 8)
    assert many == few, (few, many)

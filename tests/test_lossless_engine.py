"""Sampled speculative decoding through `LLMEngine` follows the target's distribution exactly.

`test_lossless.py` checks `verify()` on synthetic tables; this runs the whole engine: a tiny
random target and DSpark drafter over a 16-token vocabulary, many requests at three prompt
lengths in one batch (chunked prefill rides along with verification rows), a KV pool small
enough that requests are preempted and recomputed, and per-request sampling settings mixed
in one batch (T = 1, and T = 0.8 with top-k and top-p), half of the requests seeded. The
first three emitted tokens of each request are counted; their exact joint probability is
enumerated from the target with a dense forward and a temperature / top-k / top-p rule
written here independently of `dspark.sampling`. A chi-square test per policy (over every
prompt x setting group) must not reject at p = 1e-3; samples outside the support fail
outright. Deterministic: the global generator is seeded before each run.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from dspark.config import EngineConfig, ModelConfig
from dspark.drafters.registry import new_config, new_drafter
from dspark.engine.factory import assemble
from dspark.engine.gate import GateConfig
from dspark.models.decoder import CausalLM
from dspark.models.tokenizer import TextTokenizer
from dspark.sampling import SamplingParams
from dspark.spec.profile import StepProfile

V, TOKENS, COPIES = 16, 3, 240  # vocabulary, tokens compared, requests per prompt x setting
PROMPTS = [[3, 1, 4], [1, 5, 9, 2, 6, 5], [3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]]
SETTINGS = [dict(temperature=1.0), dict(temperature=0.8, top_k=6, top_p=0.85)]
POLICIES = ["static:3", "threshold:0.15", "dspark", "dspark-async", "exit:static:1"]  # exit: one-position proposals
# from a causal block's early exit (`DrafterConfig.exit_mlp`)
# the costs the dspark policies weigh (drafting is cheap); the gate is off, so every round drafts
PROFILE = StepProfile("chi2", tokens=[1, 256], verify_s=[1e-3, 1.2e-3], requests=[1, 64], draft_s=[1e-4, 2e-4])


def tiny_target() -> CausalLM:
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    net = CausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init: distributions far from uniform
        for p in net.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return net.eval()


def tiny_tokenizer() -> TextTokenizer:
    return TextTokenizer(Tokenizer(WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0")), {}, ())


def reference_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The engine's documented rule, in float64: scale by 1/T, keep the top_k most likely, then
    the smallest most-likely prefix whose mass reaches top_p (the first always stays)."""
    z = logits.double() / temperature
    order = z.argsort(-1, descending=True)
    p = z.gather(-1, order).softmax(-1)
    if top_k:
        p[..., top_k:] = 0
        p = p / p.sum(-1, keepdim=True)
    before = p.cumsum(-1) - p
    p = torch.where((before >= top_p) & (torch.arange(p.shape[-1]) > 0), 0.0, p)
    p = p / p.sum(-1, keepdim=True)
    return torch.zeros_like(p).scatter_(-1, order, p)


@torch.no_grad()
def exact_joint(net: CausalLM, prompt: list[int], setting: dict) -> torch.Tensor:
    """[V, V, V] probability of the first three tokens, every continuation enumerated."""
    pairs = torch.tensor(list(itertools.product(range(V), repeat=2)))  # [V*V, 2]
    ids = torch.cat([torch.tensor(prompt).expand(len(pairs), -1), pairs], 1)
    hidden, _ = net.forward_dense(ids)
    n = len(prompt)
    p = reference_probs(net.logits(hidden[:, n - 1 :], normed=True), **setting)  # [V*V, 3, V]
    first = p[0, 0]  # the prompt alone
    second = p[::V, 1]  # [V(x1), V]
    third = p[:, 2].reshape(V, V, V)  # [x1, x2, V]
    return first[:, None, None] * second[:, :, None] * third


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom); cells expected below 5 are pooled into one."""
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "a sequence outside the support was emitted"
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    return stat, int(keep.sum()) - 1


def p_value(stat: float, df: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return tiny_target()


@pytest.fixture(scope="module")
def exact(target) -> dict[tuple[int, int], torch.Tensor]:
    return {(i, j): exact_joint(target, prompt, s) for i, prompt in enumerate(PROMPTS) for j, s in enumerate(SETTINGS)}


def run_engine(target: CausalLM, policy: str):
    torch.manual_seed(1)
    exits, policy = policy.startswith("exit:"), policy.removeprefix("exit:")
    extra = {"causal_block": True, "exit_mlp": 16} if exits else {}
    drafter = new_drafter(new_config("dspark", target.config, V - 1, gamma=4, **extra))
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=4, num_kv_blocks=24, max_num_seqs=16,
                       max_num_batched_tokens=48)
    engine = assemble(target, tiny_tokenizer(), cfg, drafter=drafter, policy=policy, gate=GateConfig(enabled=False))
    engine.runner.set_profile(StepProfile(**{**PROFILE.__dict__}))
    torch.manual_seed(2)
    groups, reqs = [], []
    for copy in range(COPIES):  # interleaved: every group is in the batch at every moment
        for (i, prompt), (j, setting) in itertools.product(enumerate(PROMPTS), enumerate(SETTINGS)):
            seed = copy * 10 + i * 2 + j if copy % 2 else None
            params = SamplingParams(max_tokens=6, ignore_eos=True, seed=seed, **setting)
            reqs.append(engine.add_request(prompt, params))
            groups.append((i, j))
    return groups, engine.run_until_done(reqs), engine


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_engine_output_distribution_is_the_target_distribution(target, exact, policy):
    groups, outs, engine = run_engine(target, policy)
    counts = {key: torch.zeros(V, V, V, dtype=torch.float64) for key in exact}
    for key, out in zip(groups, outs, strict=True):
        counts[key][tuple(out.token_ids[:TOKENS])] += 1
    stat, df = 0.0, 0
    for key, probs in exact.items():
        s, d = chi_square(counts[key].flatten(), probs.flatten())
        stat, df = stat + s, df + d
    # the path under test was exercised: drafts verified, accepted and rejected, preemption
    assert sum(o.stats["preemptions"] for o in outs) > 0
    verified, accepted = (sum(o.stats[k] for o in outs) for k in ("verified_tokens", "accepted_tokens"))
    assert 0 < accepted < verified
    assert engine.kv.pool.num_used_blocks == 0
    assert p_value(stat, df) > 1e-3, (policy, stat, df)

"""The `Runner` interface and the plain runner: one engine step on the model.

A runner touches tensors only, never queues: it receives the scheduler's choice, feeds
each request's new tokens through one flattened target forward (`engine/batch.py`) and
returns the tokens each request emits. `ModelRunner` decodes plainly; the speculative runner
(`engine/speculative.py`: draft -> policy -> verify) reuses `sampling_rows` and
`target_forward` from here. The factory (`engine/factory.py`) builds the one an engine runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dspark.config import PAD_ROWS
from dspark.device import upload
from dspark.drafters.base import Drafter
from dspark.engine.batch import Batch, BatchRow
from dspark.engine.request import Request
from dspark.engine.scheduler import ScheduledRequest
from dspark.kv_cache import PagedKVCache
from dspark.models.decoder import CausalLM, ForwardOutput
from dspark.sampling import SamplingRows, draw
from dspark.spec.policies import NoSpeculation, Policy
from dspark.spec.profile import StepProfile

WARM_ID = "\x00warm"  # the scratch sequence of `ModelRunner.warm`, freed before any request runs


@dataclass
class StepResult:
    """Tokens emitted per request this step (absent: a prefill chunk that emits nothing)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict]] = field(default_factory=dict)
    num_computed: dict[str, int] = field(default_factory=dict)  # KV length to keep per request
    num_forward_tokens: int = 0
    drafter_ran: bool = False  # the drafter proposed tokens this step
    # speculative bookkeeping (empty under plain decoding)
    drafted: dict[str, int] = field(default_factory=dict)  # draft tokens proposed per request
    verified: dict[str, int] = field(default_factory=dict)  # l_r per request
    accepted: dict[str, int] = field(default_factory=dict)  # accepted draft tokens per request
    sources: dict[str, str] = field(default_factory=dict)  # the drafter that proposed each request's block
    times: dict[str, float] = field(default_factory=dict)  # draft / schedule / verify / accept seconds
    gate: dict | None = None  # the never-slower gate's state after the step (`Gate.snapshot`; None: no gate)


def sampling_rows(requests: Sequence[Request], repeats: Sequence[int], device) -> SamplingRows:
    """The sampling settings of logits rows, repeats[i] rows per request i."""
    return SamplingRows.build([r.params for r, n in zip(requests, repeats, strict=True) for _ in range(n)], device)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[dict]:
    """The target's log-probabilities of the emitted tokens (+ the top alternatives)."""
    logp = logits.log_softmax(-1)
    chosen = logp.gather(-1, tokens[:, None])[:, 0].tolist()
    out = [{"token_id": int(t), "logprob": float(c)} for t, c in zip(tokens.tolist(), chosen, strict=True)]
    if top > 0:
        vals, ids = logp.topk(top, dim=-1)
        for row, v, i in zip(out, vals.tolist(), ids.tolist(), strict=True):
            row["top"] = list(zip(i, v, strict=True))
    return out


class Runner(Protocol):
    """What the engine asks of a runner, plain or speculative."""

    @property
    def gamma(self) -> int:
        """Draft slots per request the scheduler reserves by default (0: plain decoding)."""
        ...

    @property
    def drafter(self) -> Drafter | None: ...

    @property
    def policy(self) -> Policy: ...

    @property
    def profile(self) -> StepProfile | None: ...

    def lookahead(self) -> int | None:
        """Draft slots to reserve next step (None: the default, `gamma`)."""
        ...

    def release(self, seq_id: str) -> None:
        """A request finished or was preempted: drop whatever the runner keeps for it."""
        ...

    def set_profile(self, profile: StepProfile) -> None:
        """Use this step-cost profile from now on."""
        ...

    def step(self, scheduled: Sequence[ScheduledRequest]) -> StepResult:
        """Run one forward for the scheduled requests; the tokens each emits."""
        ...


class ModelRunner:
    """The plain runner: one target forward, one sampled token per request where due."""

    gamma = 0
    drafter: Drafter | None = None
    profile: StepProfile | None = None

    def __init__(self, model: CausalLM, kv: PagedKVCache, pad_rows: int = PAD_ROWS) -> None:
        self.model, self.kv, self.pad_rows = model, kv, pad_rows  # pad_rows: `EngineConfig.pad_rows`
        self.device = model.device
        self.policy: Policy = NoSpeculation()

    @torch.inference_mode()
    def target_forward(self, rows: Sequence[BatchRow], taps: Sequence[int] = ()) -> tuple[Batch, ForwardOutput]:
        batch = Batch.build(rows, self.kv.pool, self.device, self.pad_rows)
        out = self.model(batch.input_ids, batch.meta, self.kv.layers, batch.logits_indices, taps)
        return batch, out

    @torch.inference_mode()
    def warm(self) -> None:
        """One forward of one token on a scratch sequence, before any request's. On an AMX CPU (Intel Xeon, family
        6, model 167) the first bfloat16 forward of a process ran, in about half of fresh processes where a
        float32 product had come first (a drafter's tables), some of its products without AMX, and so rounded
        otherwise than every later forward: the first batch's greedy speculative output parted from plain
        decoding on a near tie (`docs/architecture.md`, exactness). Every forward after one rounds the same."""
        self.kv.pool.append(WARM_ID, 1)
        try:
            self.target_forward([BatchRow(WARM_ID, [0], 1, 1)])
        finally:
            self.kv.pool.free(WARM_ID)

    def lookahead(self) -> int | None:
        """Draft slots to reserve next step: None keeps the scheduler's default (0 here)."""
        return None

    def release(self, seq_id: str) -> None:
        """A request finished or was preempted; plain decoding keeps no extra state."""

    def set_profile(self, profile: StepProfile) -> None:
        """Plain decoding weighs no costs; the profile is kept for whoever reads it."""
        self.profile = profile

    @staticmethod
    def plain_row(s: ScheduledRequest) -> BatchRow:
        """A request's known tokens for this step (a prefill chunk, or the anchor)."""
        req, start = s.request, s.request.num_computed
        return BatchRow(req.request_id, req.all_ids[start : start + s.num_new_tokens],
                        start + s.num_new_tokens, 1 if s.samples else 0)

    def sample_plain(self, result: StepResult, plain: Sequence[ScheduledRequest], batch: Batch,
                     out: ForwardOutput) -> None:
        """Rows built by `plain_row` (first in the batch): commit their tokens and sample
        one token for every request whose known tokens are now all cached."""
        for s in plain:
            result.num_computed[s.request.request_id] = s.request.num_computed + s.num_new_tokens
        sampling = [(i, s.request) for i, s in enumerate(plain) if s.samples]
        if not sampling:
            return
        reqs = [r for _, r in sampling]
        logits = out.logits[upload([batch.cu_logits[i] for i, _ in sampling], self.device)]
        rows = sampling_rows(reqs, [1] * len(reqs), self.device)
        tokens = draw(logits, rows, [r.generator for r in reqs])
        host = tokens.tolist()  # one device-to-host copy for the whole batch
        for j, r in enumerate(reqs):
            result.tokens[r.request_id] = [host[j]]
            if r.params.logprobs is not None:
                result.logprobs[r.request_id] = token_logprobs(logits[j : j + 1], tokens[j : j + 1], r.params.logprobs)

    @torch.inference_mode()
    def step(self, scheduled: Sequence[ScheduledRequest]) -> StepResult:
        """Plain decoding: feed each request's new tokens, sample one token where due."""
        result = StepResult()
        if not scheduled:
            return result
        batch, out = self.target_forward([self.plain_row(s) for s in scheduled])
        result.num_forward_tokens = batch.num_tokens
        self.sample_plain(result, scheduled, batch, out)
        return result

"""The engine loop: `schedule -> runner.step -> update`, with continuous batching.

Requests join (`add_request`) and leave (finish, abort) between steps. `step()` runs one
flattened forward for every scheduled request and returns a `StepOutput` that says what
the step did, so callers can stream and measure. The runner (`engine/runner.py`: plain, or
`engine/speculative.py`) is built by the factory (`engine/factory.py`); the loop reads the
same either way.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from types import MappingProxyType

import torch

from dspark.config import EngineConfig
from dspark.engine.output import RequestOutput, StepFailed, StepOutput
from dspark.engine.request import Request, Status
from dspark.engine.runner import Runner, StepResult
from dspark.engine.scheduler import ScheduledRequest, Scheduler
from dspark.kv_cache import PagedKVCache
from dspark.models.decoder import CausalLM
from dspark.models.detokenize import Detokenizer
from dspark.models.tokenizer import TextTokenizer
from dspark.sampling import SamplingParams


class LLMEngine:
    """Continuous-batching engine over a KV cache and a runner (build one with
    `engine.factory.assemble` or `build_engine`)."""

    def __init__(self, model: CausalLM, tokenizer: TextTokenizer, cfg: EngineConfig, kv: PagedKVCache,
                 runner: Runner) -> None:
        self.model, self.tokenizer, self.cfg, self.kv, self.runner = model, tokenizer, cfg, kv, runner
        self.drafter, self.policy = runner.drafter, runner.policy
        # unseeded requests draw from this engine's generator: seeding torch's global RNG would
        # reseed the caller's process (and every other engine in it)
        self.generator = torch.Generator(device=model.device).manual_seed(cfg.seed)
        capacity = self.kv.pool.num_blocks * cfg.block_size - runner.gamma
        self.max_model_len = min(cfg.max_model_len or model.config.max_position_embeddings, capacity)
        self.scheduler = Scheduler(cfg, self.kv.pool, runner.gamma)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = self.num_drafted_steps = 0
        self.totals: dict[str, float] = {}
        # where request timestamps (arrival, first token, finish) come from; a benchmark that steps
        # several engines in turn gives each its own clock that runs only while that engine works
        self.clock: Callable[[], float] = time.perf_counter

    # ---- requests -------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError("a prompt is a string or a list of token ids")
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the context holds {self.max_model_len} "
                f"(at least one more is needed to generate)"
            )
        return ids

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        """Validate and queue a request; bad input raises ValueError and changes nothing."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        ids = self.encode_prompt(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, ids, params, self.tokenizer.eos_token_ids, self.max_model_len, self.model.device,
                      self.generator, Detokenizer(self.tokenizer, params.stop))
        req.stats.arrival_time = self.clock()
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        """Finish a request early (reason `abort`); an unknown or finished id is a no-op."""
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort", self.clock())

    def gate_state(self) -> tuple[bool, bool] | None:
        """The never-slower gate after the last step: (open, whether that step was its probe); None without a
        gate judging (plain decoding, a policy that drafts unconditionally, or no step profile)."""
        gate = getattr(self.runner, "gate", None)
        return None if gate is None or gate.idle else (gate.open, self.runner.probed)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -------------------------------------------------------------------
    def step(self) -> StepOutput:
        """One engine step: what was scheduled, computed, drafted, verified and emitted. A
        finished request has already left `requests` (read it through `progressed`). A forward
        that raises becomes `StepFailed` naming the requests the step ran."""
        plan = self.scheduler.schedule(self.runner.lookahead())
        for req in plan.preempted:
            self.runner.release(req.request_id)
        if not plan.scheduled:
            return StepOutput(plan)
        try:
            result = self.runner.step(plan.scheduled)
            self.num_steps += 1
            self.num_drafted_steps += int(result.drafter_ran)
            touched = self.update(plan.scheduled, result)
        except Exception as exc:
            raise StepFailed([s.request.request_id for s in plan.scheduled], exc) from exc
        frozen = MappingProxyType
        return StepOutput(
            plan, tuple(touched), tuple(r for r in touched if r.is_finished),
            frozen({rid: tuple(t) for rid, t in result.tokens.items()}), result.num_forward_tokens,
            result.drafter_ran, frozen(dict(result.drafted)), frozen(dict(result.verified)),
            frozen(dict(result.accepted)), frozen(dict(result.times)),
            None if result.gate is None else frozen(result.gate))

    def update(self, scheduled: Sequence[ScheduledRequest], result: StepResult) -> list[Request]:
        touched = []
        now = self.clock()
        for key, seconds in result.times.items():
            self.totals[key] = self.totals.get(key, 0.0) + seconds
        for s in scheduled:
            req = s.request
            self.scheduler.commit(req, result.num_computed[req.request_id])
            record_speculation(req, result)
            tokens = result.tokens.get(req.request_id)
            if tokens:
                self.emit(req, tokens, result.logprobs.get(req.request_id), now)
                touched.append(req)
        return touched

    def emit(self, req: Request, tokens: list[int], logprobs: list[dict] | None, now: float) -> None:
        """Append tokens to req, applying stop ids, stop strings, max_tokens and context."""
        if req.stats.first_token_time is None:
            req.stats.first_token_time = now
        req.stats.rounds += 1
        reason = None
        for i, tok in enumerate(tokens):
            req.append(tok)
            req.stats.completion_tokens += 1
            if logprobs is not None:
                req.output_logprobs.append(logprobs[i])
            reason = self._stop_reason(req, tok)
            if reason:
                break
        if reason:
            self.finish(req, reason, now)

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        if tok in req.stop_ids:
            return "stop"
        if req.detokenizer is not None and req.detokenizer.stop_at is not None:  # a stop string appeared
            return "stop"
        if len(req.output_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, req: Request, reason: str, now: float) -> None:
        """Retire req: the one place a request leaves the engine (its blocks, drafter state and
        table entry go); the caller keeps the Request object to read its output."""
        if req.detokenizer is not None:
            req.text = req.detokenizer.final(req.output_ids)
        self.scheduler.finish(req, reason)
        self.runner.release(req.request_id)
        self.requests.pop(req.request_id, None)
        req.stats.finish_time = now

    def output(self, req: Request) -> RequestOutput:
        text = req.text if req.is_finished or req.detokenizer is None else req.detokenizer.text
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_ids, text=text,
            token_ids=list(req.output_ids), finish_reason=req.finish_reason, stats=req.stats.as_dict(),
            logprobs=req.output_logprobs if req.params.logprobs is not None else None,
        )

    def run_until_done(self, requests: Sequence[Request]) -> list[RequestOutput]:
        while any(r.status is not Status.FINISHED for r in requests):
            self.step()
        return [self.output(r) for r in requests]


def record_speculation(req: Request, result: StepResult) -> None:
    """Fold one step's draft/verify/accept counts and time split into the request's stats."""
    st, rid = req.stats, req.request_id
    st.draft_tokens += result.drafted.get(rid, 0)
    ell, n = result.verified.get(rid, 0), result.accepted.get(rid, 0)
    st.verified_tokens += ell
    st.accepted_tokens += n
    source = result.sources.get(rid)
    if source is not None:
        st.draft_tokens_by[source] = st.draft_tokens_by.get(source, 0) + result.drafted.get(rid, 0)
        st.accepted_tokens_by[source] = st.accepted_tokens_by.get(source, 0) + n
    if ell:
        width = max(ell, len(st.verified_per_position))
        st.verified_per_position += [0] * (width - len(st.verified_per_position))
        st.accepted_per_position += [0] * (width - len(st.accepted_per_position))
        for k in range(min(n + 1, ell)):
            st.verified_per_position[k] += 1
            st.accepted_per_position[k] += 1 if k < n else 0
    for key, seconds in result.times.items():
        st.step_seconds[key] = st.step_seconds.get(key, 0.0) + seconds

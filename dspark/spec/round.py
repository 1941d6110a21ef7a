"""One speculative round for every running request (DESIGN.md §3, issue [E] item 1).

draft (batched) -> policy chooses l_r -> ONE flattened target forward over
`[anchor, x_1..x_l]` of every decoding request, with new requests' prefill chunks in the
same forward -> rejection sampling per request -> emit accepted + recovered/bonus tokens ->
the engine rolls the target KV back past the accepted prefix -> the drafter receives the
tapped features of the newly committed tokens. A request with l_r = 0 advances one token
exactly as plain decoding does.

The never-slower gate decides *before* drafting, from the profile and the acceptance of
earlier steps (never this step's draft tokens), whether drafting pays; if not, the step
decodes plainly without calling the drafter, probing again with growing intervals.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.device import upload
from dspark.drafters.base import ContextRow, DraftBlock, Drafter, ProposeInput
from dspark.engine.batch import BatchRow
from dspark.engine.request import Request
from dspark.engine.runner import ModelRunner, StepResult, sampling_rows, token_logprobs
from dspark.engine.scheduler import ScheduledRequest
from dspark.sampling import probabilities
from dspark.spec.profile import StepProfile
from dspark.spec.schedule import NoSpeculation, Policy, algorithm1, uniform_candidates
from dspark.spec.stats import AcceptanceStats
from dspark.spec.verify import verify, verify_greedy


@dataclass(frozen=True)
class GateConfig:
    enabled: bool = True
    probe_every: int = 8  # first probe after this many undrafted steps; doubles while drafting loses
    probe_max: int = 256  # the interval stops doubling here where probes are cheap ...
    probe_budget: float = 0.0025  # ... and further out where they are not: probes (their cost beyond a plain
    # step, from the profile) add at most this fraction to the steps between them (0: off)
    probe_ceiling: int = 4096  # the interval never grows past this (new traffic is found within it)
    explore_budget: float = 0.02  # while the interval doubles, it is at least long enough that a probe's
    # extra cost is this fraction of the steps before the next one (0: off): on a fresh engine the
    # doubling alone probed at steps 8, 24, 56, 120, 248, about 2% of a 512-step run at one request
    recheck_every: int = 16  # a cached verdict is recomputed at least this often (the profile drifts online)
    probe_requests: int = 2  # a probe drafts for this many requests (the acceptance estimates are shared)
    caution: float = 1.0  # standard errors taken off the acceptance estimates before judging: opening
    # on a few lucky probe observations drafts for every request, a loss when the luck does not hold


class Gate:
    """Predicts whether drafting pays, from history only (lossless).

    The gate judges the *decode-alone* shape (the decoding requests, no prefill chunks). A step
    that shares its forward with prefill chunks looks as if a few draft tokens were free (the
    chunks make the forward slow anyway), but opening there drafts for every request after a
    closed spell, each first catching up its whole pending context, a cost the profile's draft
    time (measured with the context already written) does not hold. Once open, Algorithm 1 still sizes
    the budget with the prefill tokens counted. The verdict depends on the number of requests, the
    acceptance estimates and the profile; it is cached until one of the first two changes or
    `recheck_every` steps pass, so a closed gate costs a dictionary lookup per step. Behind a
    router (`auto`), the drafter's cost is weighed for the share of requests the router has lately
    given its costly drafter (the copy drafter costs about nothing), not for all of them.
    """

    def __init__(self, cfg: GateConfig, stats: AcceptanceStats, profile: StepProfile | None) -> None:
        self.cfg, self.stats, self.profile = cfg, stats, profile
        self.wait, self.interval = 0, cfg.probe_every
        self.probing = False
        self.open = True  # the last verdict (slots are reserved for the first step)
        self.memo: tuple[tuple, int, bool] | None = None  # (key, age in steps, verdict)
        self.draft_share = 1.0  # smoothed fraction of drafted requests a router gives its costly drafter

    def cost(self, r: float, b: int) -> float:
        """A drafted step's seconds: the costly drafter runs for draft_share of the r requests."""
        assert self.profile is not None
        k = r * self.draft_share  # below one request: a run for one in that fraction of the steps
        return (self.profile.draft(k) if k >= 1 else k * self.profile.draft(1)) + self.profile.verify(b)

    def observe_share(self, drafted: int, requests: int) -> None:
        self.draft_share = 0.9 * self.draft_share + 0.1 * drafted / requests

    @property
    def idle(self) -> bool:
        """Disabled, or no profile to judge by: every step with slots drafts."""
        return not self.cfg.enabled or self.profile is None

    def should_draft(self, num_requests: int, caps: Sequence[int]) -> bool:
        """A step scheduled with draft slots: draft (verdict open, or a probe is due) or not."""
        self.probing = False
        if self.idle:
            return True
        if self.judge(num_requests, caps):
            return True
        self.wait += 1
        if self.wait >= self.interval:  # probe: refresh the acceptance estimates
            longest = self.longest_interval(num_requests)
            self.wait, self.interval = 0, min(longest, max(self.interval * 2, self.shortest_interval(num_requests)))
            self.probing = True
            return True
        return False

    def longest_interval(self, num_requests: int) -> int:
        """probe_max, or more where a probe costs more than probe_budget of the plain steps
        between probes (a probe drafts, then verifies more tokens than a plain step would)."""
        if not self.cfg.probe_budget or self.profile is None:
            return self.cfg.probe_max
        extra = self.probe_cost(num_requests)
        return min(self.cfg.probe_ceiling, max(self.cfg.probe_max, math.ceil(extra / self.cfg.probe_budget)))

    def shortest_interval(self, num_requests: int) -> int:
        """The fewest steps to the next probe: its extra cost at most explore_budget of them."""
        if not self.cfg.explore_budget or self.profile is None:
            return 1
        return math.ceil(self.probe_cost(num_requests) / self.cfg.explore_budget)

    def probe_cost(self, num_requests: int) -> float:
        """What a probe adds to a plain step of these requests, in plain steps (from the profile)."""
        assert self.profile is not None
        k = min(self.cfg.probe_requests, num_requests)
        plain = self.profile.verify(num_requests)
        return max(0.0, (self.profile.cost(k, num_requests + k) - plain) / plain)  # a probe verifies >= 1 token each

    def withheld(self, num_requests: int, gamma: int) -> None:
        """A step scheduled without draft slots (the gate was closed): advance the probe clock
        and judge whether drafting would pay now, so that the next step reserves slots."""
        self.probing = False
        if self.idle:
            return
        if not self.judge(num_requests, [gamma] * num_requests):
            self.wait += 1

    def judge(self, num_requests: int, caps: Sequence[int]) -> bool:
        """The verdict for decoding these requests alone, remembered as `open`. When it pays, the
        probe backoff restarts, so that after the next close the gate probes soon again."""
        self.open = self.pays(num_requests, caps)
        if self.open:
            self.interval = self.cfg.probe_every
        return self.open

    def wants_slots(self) -> bool:
        """Whether the next step should reserve draft slots (KV and token budget). A closed gate
        withholds them: reserving and rolling back γ slots per request on every step slowed plain
        decoding at 16 requests (`docs/results/hostile-c16*`)."""
        return self.idle or self.open or self.wait + 1 >= self.interval

    def probe_subset(self, decode: Sequence, step: int) -> list:
        """The requests a probe drafts for: a window of `probe_requests`, rotating with the step,
        so a probe at 64 requests costs a draft for two, not for 64."""
        k = self.cfg.probe_requests
        if len(decode) <= k:
            return list(decode)
        return [decode[(step + i) % len(decode)] for i in range(k)]

    def pays(self, num_requests: int, caps: Sequence[int]) -> bool:
        key = (num_requests, tuple(caps), self.stats.version)
        if self.memo is not None and self.memo[0] == key and self.memo[1] < self.cfg.recheck_every:
            self.memo = (key, self.memo[1] + 1, self.memo[2])
            return self.memo[2]
        verdict = self.predict(num_requests, caps)
        self.memo = (key, 1, verdict)
        return verdict

    def predict(self, num_requests: int, caps: Sequence[int]) -> bool:
        """Algorithm 1 on the cautious acceptance estimates: does its best budget beat plain?"""
        assert self.profile is not None
        cands = uniform_candidates(self.stats.lower(self.cfg.caution), caps)
        admitted = algorithm1(cands, num_requests, 0, self.cost)
        gain = sum(c.survival for c in cands[:admitted])
        spec = (num_requests + gain) / self.cost(num_requests, num_requests + admitted)
        plain = num_requests / self.profile.verify(num_requests)
        return spec > plain


class SpecRunner:
    def __init__(self, base: ModelRunner, drafter: Drafter, policy: Policy, profile: StepProfile | None,
                 gate: GateConfig | None = None) -> None:
        self.base, self.drafter, self.policy, self.profile = base, drafter, policy, profile
        self.gamma = drafter.gamma
        self.stats = AcceptanceStats(self.gamma)
        use_gate = (gate or GateConfig()).enabled and policy.needs_cost
        self.gate = Gate(gate or GateConfig(enabled=use_gate), self.stats, profile) if use_gate else None
        self.device = base.device
        self.steps = self.drafted_steps = 0
        self.pending = PendingContext()
        self.recorder: list[tuple[torch.Tensor, list[int], list[int]]] | None = None  # (conf logits, l, accepted)
        drafter.set_profile(profile)

    def set_profile(self, profile: StepProfile) -> None:
        self.profile = profile
        self.drafter.set_profile(profile)
        if self.gate is not None:
            self.gate.profile = profile

    def lookahead(self) -> int | None:
        """Draft slots the scheduler should reserve next step (None: the engine's default, γ)."""
        return None if self.gate is None or self.gate.wants_slots() else 0

    def release(self, seq_id: str) -> None:
        self.pending.drop(seq_id)
        self.drafter.free(seq_id)

    @torch.inference_mode()
    def step(self, scheduled: Sequence[ScheduledRequest]) -> StepResult:
        result, t0 = StepResult(), time.perf_counter()
        for s in scheduled:
            if s.request.num_computed == 0:
                self.release(s.request.request_id)  # fresh, or recomputed after preemption
        decode = [s for s in scheduled if self._decodes(s)]
        caps = [s.num_lookahead for s in decode]
        other_tokens = sum(s.num_new_tokens for s in scheduled if not self._decodes(s))
        drafting = bool(decode) and not isinstance(self.policy, NoSpeculation) and any(caps)
        if decode and not drafting and self.gate is not None:
            self.gate.withheld(len(decode), self.gamma)
        if drafting and self.gate is not None:
            drafting = self.gate.should_draft(len(decode), caps)
            if drafting and self.gate.probing:
                decode = self.gate.probe_subset(decode, self.steps)
                caps = [s.num_lookahead for s in decode]
        if not drafting:
            decode = []  # every request takes the plain path; the drafter is not called
        drafted_ids = {id(s) for s in decode}
        plain = [s for s in scheduled if id(s) not in drafted_ids]
        block, lengths = None, [0] * len(decode)
        if decode:
            self.drafter.extend(self.pending.take([s.request for s in decode]))
            block = self._propose(decode)
            result.times["draft"] = time.perf_counter() - t0
            lengths = self._choose(block, caps, other_tokens)
        t1 = time.perf_counter()
        result.times["schedule"] = t1 - t0 - result.times.get("draft", 0.0)
        drafts = block.tokens.tolist() if block is not None else []  # one host copy for every request
        rows = [self.base.plain_row(s) for s in plain] + [self._verify_row(s, d[:ell]) for s, d, ell in
                                                      zip(decode, drafts, lengths, strict=True)]
        batch, out = self.base.target_forward(rows, self.drafter.taps)
        t2 = time.perf_counter()
        result.times["verify"] = t2 - t1
        result.num_forward_tokens = batch.num_tokens
        self.base.sample_plain(result, plain, batch, out)
        if decode:
            self._verify(result, decode, block, lengths, batch, out, len(plain))
        self._commit_context(result, [*plain, *decode], batch, out)
        result.times["accept"] = time.perf_counter() - t2
        drafted = len(decode) if block is None or block.num_drafted is None else block.num_drafted
        if decode and self.gate is not None and block is not None and block.num_drafted is not None:
            self.gate.observe_share(drafted, len(decode))
        self._observe(drafted, batch.num_tokens, result, drafting)
        return result

    # ---- pieces ---------------------------------------------------------------------------
    @staticmethod
    def _decodes(s: ScheduledRequest) -> bool:
        return s.samples and s.num_new_tokens == 1 and bool(s.request.output_ids)

    def _propose(self, decode: Sequence[ScheduledRequest]) -> DraftBlock:
        reqs = [s.request for s in decode]
        inputs = [ProposeInput(r.request_id, r.all_ids[-1], r.num_computed, r.all_ids, r.generator) for r in reqs]
        return self.drafter.propose(inputs, sampling_rows(reqs, [1] * len(reqs), self.device))

    def _choose(self, block: DraftBlock, caps: list[int], other_tokens: int) -> list[int]:
        if block.num_valid is not None:
            caps = [min(c, v) for c, v in zip(caps, block.num_valid, strict=True)]
        conf = block.confidence
        if conf is None:
            conf = torch.tensor([self.stats.conditional()] * len(caps))
        cost = self.profile.cost if self.profile is not None else (lambda r, b: 1.0)
        profile, drafted = self.profile, block.num_drafted
        if drafted is not None and profile is not None:  # a router ran its costly drafter for these requests only
            cost = lambda r, b: profile.cost(drafted, b)  # noqa: E731
        lengths = self.policy.choose(conf.float().cpu(), caps, other_tokens, cost)
        if self.gate is not None and self.gate.probing:  # a probe verifies at least one token
            lengths = [max(ell, min(1, c)) for ell, c in zip(lengths, caps, strict=True)]
        return [min(ell, c) for ell, c in zip(lengths, caps, strict=True)]

    @staticmethod
    def _verify_row(s: ScheduledRequest, drafts: list[int]) -> BatchRow:
        req, ell = s.request, len(drafts)
        return BatchRow(req.request_id, [req.all_ids[-1], *drafts], req.num_computed + 1 + ell, 1 + ell)

    def _verify(self, result, decode, block: DraftBlock, lengths, batch, out, n_plain: int) -> None:
        reqs = [s.request for s in decode]
        g = self.gamma
        logits = out.logits[batch.cu_logits[n_plain] :]  # verify rows come last: 1 + l_r logits per request
        offsets = [0]
        for ell in lengths:
            offsets.append(offsets[-1] + 1 + ell)
        verdict = self._verdict(reqs, block, logits, lengths)
        for i, (r, ell) in enumerate(zip(reqs, lengths, strict=True)):
            n = verdict.num_accepted[i]
            result.tokens[r.request_id] = verdict.tokens[i]
            result.num_computed[r.request_id] = r.num_computed + 1 + n
            result.drafted[r.request_id] = g if block.num_valid is None else block.num_valid[i]
            result.verified[r.request_id], result.accepted[r.request_id] = ell, n
            result.sources[r.request_id] = self.drafter.config.kind if block.sources is None else block.sources[i]
            if r.params.logprobs is not None:
                emitted = upload(verdict.tokens[i], self.device)
                result.logprobs[r.request_id] = token_logprobs(logits[offsets[i] : offsets[i] + n + 1], emitted,
                                                               r.params.logprobs)
        if any(lengths):
            self.stats.update(lengths, verdict.num_accepted)
        if self.recorder is not None and block.confidence_logits is not None:
            self.recorder.append((block.confidence_logits.float().cpu(), list(lengths), list(verdict.num_accepted)))

    def _verdict(self, reqs: Sequence[Request], block: DraftBlock, logits: torch.Tensor, lengths: list[int]):
        """Rejection sampling of every request's verified prefix against its 1 + l_r target logits rows."""
        where = [(i, k) for i, ell in enumerate(lengths) for k in range(1 + ell)]  # logits row -> (request, k)
        index = upload(where, self.device)
        shape = (len(reqs), self.gamma + 1)
        if all(r.params.greedy for r in reqs):  # the target's argmax per position, no [R, G+1, V] distributions
            picks = torch.zeros(shape, dtype=torch.long, device=self.device)
            picks[index[:, 0], index[:, 1]] = logits.argmax(-1)
            return verify_greedy(block.tokens, picks, upload(lengths, self.device))
        rows = sampling_rows(reqs, [1 + ell for ell in lengths], self.device)
        padded = torch.zeros(*shape, logits.shape[-1], device=self.device)
        padded[index[:, 0], index[:, 1]] = probabilities(logits, rows)  # one scatter, not one copy per request
        return verify(block.tokens, block.probs, padded, upload(lengths, self.device), [r.generator for r in reqs])

    def _commit_context(self, result: StepResult, ordered, batch, out) -> None:
        """Queue the tapped features of every token now committed to the target cache; the
        drafter receives them right before it next drafts for that request."""
        keeps = [result.num_computed[s.request.request_id] - s.request.num_computed for s in ordered]
        feats: Sequence[torch.Tensor | None] = [None] * len(ordered)
        if out.taps is not None:
            kept = out.taps
            if sum(keeps) != batch.num_tokens:
                # rejected draft rows: one gather of the kept rows (a copy: views of the step's whole
                # tapped tensor would keep the rejected rows alive until every request drafts)
                flat = [batch.offsets[i] + k for i, keep in enumerate(keeps) for k in range(keep)]
                kept = out.taps[upload(flat, out.taps.device, torch.long)]
            # else every row is kept whole (an undrafted step): the tapped tensor is the kept rows
            feats = kept.split(keeps)  # cheap views, one per request
        for s, keep, feat in zip(ordered, keeps, feats, strict=True):
            self.pending.add(s.request.request_id, s.request.num_computed, keep, feat)

    def _observe(self, num_decode: int, num_tokens: int, result: StepResult, drafted: bool) -> None:
        self.steps += 1
        self.drafted_steps += int(drafted)
        if self.profile is None:
            return
        self.profile.observe_verify(num_tokens, result.times["verify"])
        if drafted and num_decode:
            self.profile.observe_draft(num_decode, result.times["draft"])


class PendingContext:
    """Committed tokens whose features the drafter has not received yet. Handing them over
    lazily keeps undrafted steps (gate closed, hostile prompts) free of drafter work; each step
    adds one feature chunk per request (the token ids are the request's own, read at hand-over)."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[int, list[int], list[torch.Tensor | None]]] = {}  # id -> (start, sizes, chunks)

    def add(self, seq_id: str, start: int, num_tokens: int, features: torch.Tensor | None) -> None:
        if num_tokens <= 0:
            return
        entry = self.rows.get(seq_id)
        if entry is None:
            self.rows[seq_id] = (start, [num_tokens], [features])
        else:
            entry[1].append(num_tokens)
            entry[2].append(features)

    def drop(self, seq_id: str) -> None:
        self.rows.pop(seq_id, None)

    def take(self, requests: Sequence[Request]) -> list[ContextRow]:
        """One merged row per request (features concatenated), removed from the queue."""
        out = []
        for req in requests:
            entry = self.rows.pop(req.request_id, None)
            if entry is None:
                continue
            start, sizes, chunks = entry
            feats = None if chunks[0] is None else torch.cat(chunks) if len(chunks) > 1 else chunks[0]
            out.append(ContextRow(req.request_id, start, req.all_ids[start : start + sum(sizes)], feats))
        return out

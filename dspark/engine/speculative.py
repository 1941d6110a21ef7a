"""The speculative runner: one speculative step for every running request.

draft (batched) -> the policy chooses l_r -> ONE flattened target forward over
`[anchor, x_1..x_l]` of every decoding request, with new requests' prefill chunks in the
same forward -> rejection sampling per request (`spec/verify.py`) -> emit accepted +
recovered/bonus tokens -> the engine rolls the target KV back past the accepted prefix -> the
drafter receives the tapped features of the newly committed tokens (`engine/pending.py`).
A request with l_r = 0 advances one token exactly as plain decoding does. The gate
(`engine/gate.py`) may decide a step decodes plainly without calling the drafter.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from dspark.device import upload
from dspark.drafters.base import DraftBlock, Drafter, ProposeInput
from dspark.engine.batch import BatchRow
from dspark.engine.gate import Gate, GateConfig
from dspark.engine.pending import PendingContext
from dspark.engine.request import Request
from dspark.engine.runner import ModelRunner, StepResult, sampling_rows, token_logprobs
from dspark.engine.scheduler import ScheduledRequest
from dspark.sampling import probabilities
from dspark.spec.policies import NoSpeculation, Policy
from dspark.spec.profile import StepProfile
from dspark.spec.stats import AcceptanceStats
from dspark.spec.verify import verify, verify_greedy


class SpeculativeRunner:
    """A `Runner` that drafts, lets the policy choose how much to verify, and verifies."""

    def __init__(self, base: ModelRunner, drafter: Drafter, policy: Policy, profile: StepProfile | None,
                 gate: GateConfig | None = None) -> None:
        self.base, self.drafter, self.policy = base, drafter, policy
        self.profile = profile
        self.gamma = drafter.gamma
        self.stats = AcceptanceStats(self.gamma)
        self.own: dict[str, AcceptanceStats] = {}  # each request's own record, for the gate (keeps_records)
        use_gate = (gate or GateConfig()).enabled and policy.needs_cost
        self.gate = Gate(gate or GateConfig(enabled=use_gate), self.stats, self.profile, drafter.cuts_exactly) \
            if use_gate else None
        self.device = base.device
        self.steps = self.drafted_steps = 0
        self.pending = PendingContext()
        self.recorder: list[tuple[torch.Tensor, list[int], list[int]]] | None = None  # (conf logits, l, accepted)
        self.snapshots = False  # each step's result carries the gate's state (`Gate.snapshot`; a step trace asks)
        self.probed = False  # the last step was a closed gate's probe (the gate's own flag is not reset by a step
        # that judged nothing, a prefill alone)
        drafter.set_profile(self.profile)

    def set_profile(self, profile: StepProfile) -> None:
        self.profile = profile
        self.drafter.set_profile(profile)
        if self.gate is not None:
            self.gate.profile = profile

    def lookahead(self) -> int | None:
        """Draft slots the scheduler should reserve next step (None: the engine's default, γ)."""
        return None if self.gate is None or self.gate.wants_slots() else 0

    @property
    def keeps_records(self) -> bool:
        """Whether requests keep their own acceptance records: only the gate reads them, and not for
        a bursty drafter (`Drafter.bursty`)."""
        return self.gate is not None and not self.drafter.bursty

    def release(self, seq_id: str) -> None:
        self.pending.drop(seq_id)
        self.drafter.free(seq_id)
        self.own.pop(seq_id, None)

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
        own = [self.own.get(s.request.request_id) for s in decode] if self.keeps_records else []
        sampled = self._samples(decode)
        if decode and not drafting and self.gate is not None:
            self.gate.withheld(len(decode), self.gamma, own, sampled)
        decoding = len(decode)
        if drafting and self.gate is not None:
            drafting = self.gate.should_draft(decoding, caps, own, sampled)
            if drafting:  # a probe, or an open verdict, may draft for some; the rest decode plainly alongside
                decode = self.gate.probe_subset(decode, self.steps) if self.gate.probing else self.gate.chosen(decode)
                caps, sampled = [s.num_lookahead for s in decode], self._samples(decode)
        if not drafting:
            decode = []  # every request takes the plain path; the drafter is not called
        drafted_ids = {id(s) for s in decode}
        plain = [s for s in scheduled if id(s) not in drafted_ids]
        block, lengths = None, [0] * len(decode)
        deepest = self.policy.deepest
        depth = deepest if self.gate is None else self.gate.step_depth(decoding, deepest)  # None: gamma
        if decode:
            self.drafter.extend(self.pending.take([s.request for s in decode]))
            caught_up = time.perf_counter()
            block = self._propose(decode, depth)
            proposed = time.perf_counter()
            # catch_up: the context committed since the drafter last drafted for these requests
            result.times["catch_up"], result.times["draft"] = caught_up - t0, proposed - caught_up
            lengths = self._choose(block, caps, other_tokens, depth, sampled, decoding - len(decode), len(scheduled))
        t1 = time.perf_counter()
        result.times["schedule"] = t1 - t0 - sum(result.times.values())
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
        result.drafter_ran = drafting
        self._observe(drafted, batch.num_tokens, result, drafting, depth, sampled, len(rows))
        self.probed = drafting and self.gate is not None and self.gate.probing
        if self.probed and not other_tokens:
            self.gate.observe_probe(decoding, sum(result.times.values()))
        if self.snapshots and self.gate is not None and not self.gate.idle:
            result.gate = self.gate.snapshot(self.probed)
        return result

    # ---- pieces ---------------------------------------------------------------------------
    @staticmethod
    def _samples(decode: Sequence[ScheduledRequest]) -> bool:
        """Whether any of these requests samples: its proposal then drafts over every token, not the
        draft vocabulary alone (`NeuralDrafter.select_vocab`), and is priced so."""
        return not all(s.request.params.greedy for s in decode)

    @staticmethod
    def _decodes(s: ScheduledRequest) -> bool:
        return s.samples and s.num_new_tokens == 1 and bool(s.request.output_ids)

    def _propose(self, decode: Sequence[ScheduledRequest], depth: int | None) -> DraftBlock:
        reqs = [s.request for s in decode]
        inputs = [ProposeInput(r.request_id, r.all_ids[-1], r.num_computed, r.all_ids, r.generator) for r in reqs]
        return self.drafter.propose(inputs, sampling_rows(reqs, [1] * len(reqs), self.device), depth)

    def _choose(self, block: DraftBlock, caps: list[int], other_tokens: int, depth: int | None,
                sampled: bool = False, plain_rows: int = 0, rows: int | None = None) -> list[int]:
        if block.num_valid is not None:
            caps = [min(c, v) for c, v in zip(caps, block.num_valid, strict=True)]
        conf = block.confidence
        if conf is None:
            conf = torch.tensor([self.stats.conditional()] * len(caps))
        profile, drafted = self.profile, block.num_drafted
        cost = (lambda r, b: 1.0) if profile is None else lambda r, b: profile.cost(r, b, depth, sampled, rows)  # noqa: E731
        if drafted is not None and profile is not None:  # a router ran its costly drafter for these requests only
            cost = lambda r, b: profile.cost(drafted, b, depth, sampled, rows)  # noqa: E731
        lengths = self.policy.choose(conf.float().cpu(), caps, other_tokens, cost, plain_rows)
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
            for r, ell, n in zip(reqs, lengths, verdict.num_accepted, strict=True):
                if ell and self.keeps_records:
                    self.own.setdefault(r.request_id, AcceptanceStats(self.gamma)).update([ell], [n])
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
        return verify(block.tokens, block.distributions(logits.shape[-1]), padded, upload(lengths, self.device), [r.generator for r in reqs])

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

    def _observe(self, num_decode: int, num_tokens: int, result: StepResult, drafted: bool,
                 depth: int | None = None, sampled: bool = False, rows: int | None = None) -> None:
        self.steps += 1
        self.drafted_steps += int(drafted)
        if self.profile is None:
            return
        # the whole step but its catch-up: that is paid once per context token (when a request first
        # drafts, or after a closed spell), not per step, and one such step weighed like the rest
        # made drafting look twice as costly as it is
        seconds = sum(result.times.values()) - result.times.get("catch_up", 0.0)
        # the target's forward: what the profile timed, the machine's speed. On CUDA the forward returns once
        # its kernels are queued and the step waits for them later, so only the whole step is timed there
        forward = result.times.get("verify") if self.device.type == "cpu" else None
        if drafted:
            self.profile.observe_drafted(num_decode, num_tokens, seconds, depth, forward, sampled, rows)
        else:
            self.profile.observe_plain(num_tokens, seconds, forward, rows)


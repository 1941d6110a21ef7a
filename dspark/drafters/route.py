"""Per-request routing between a neural drafter and the suffix drafter (`auto`, `dspark+suffix`).

Every step the suffix drafter proposes for every request first (host work, cost about 0); its
calibrated confidences give each request's expected accepted tokens E_copy, the sum of its prefix
survival products (the quantity Algorithm 1 ranks). The neural drafter's expectation E_neural is
predicted per request from the survival sums of its own confidence head the last times it drafted
for that request (untried requests: the mean over all of them), times kappa: the draft tokens the
requests then really committed over the survival sums that promised them, over the neural
drafter's recent blocks (a head calibrated on other traffic can promise tokens that never come;
a block's committed prefix is its accepted tokens, as a rejected token is never the recovered
one); kappa starts from a prior of `PRIOR_TOKENS` kept of as many promised, so the first few blocks
do not decide it alone. Requests are then ordered by
E_neural - E_copy, and the first k of them go to the neural drafter for the k that maximises expected
tokens per second of the step, (R + sum of E) / (draft(k) + verify(B)) from the step profile (the
neural drafter's proposal for k requests; the copy drafter's cost taken as 0). The
neural drafter then runs for those requests alone; its context features wait here until a
request is routed to it, so copy-served requests cost it nothing.

An estimate that is never tested again never recovers: three failed early blocks put the
neural expectation at 0.24 tokens for a single code request on dspark-small, and the router then
copied for its remaining 90 steps (τ 1.38) where the DSpark drafter alone reached τ 1.64. So a
request the neural drafter has not drafted for in `probe_every` steps is routed to it once (a probe,
at most `probes_per_step` requests per step, the longest-waiting first), and its interval doubles up to
`probe_max` each time a probe is not followed by a win on merit. A probe rides along free where the
neural drafter runs for others anyway; where it would start the drafter for nobody else, probes are
spaced so that their proposals cost at most `probe_budget` of the plain steps between them.

The choice reads only the deterministic copy proposal and earlier steps, never this step's
sampled neural tokens, and each request's block is verified against the distribution it was
drawn from, so the output distribution is the target's (tests/test_route.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dspark.drafters.base import ContextRow, DraftBlock, Drafter, DrafterConfig, ProposeInput, Waiting
from dspark.drafters.suffix import SuffixDrafter
from dspark.sampling import SamplingRows
from dspark.spec.profile import StepProfile

PRIOR_TOKENS = 4.0  # kappa's prior: this many tokens kept of as many promised (about two blocks' worth)


def expected_tokens(conf: torch.Tensor, valid: Sequence[int]) -> list[float]:
    """Per request, the sum of prefix survival products over its valid positions."""
    surv = torch.cumprod(conf.double().cpu(), dim=1).tolist()
    return [sum(s[:v]) for s, v in zip(surv, valid, strict=True)]


def route(copy: Sequence[float], neural: Sequence[float], profile: StepProfile | None, other: int = 0,
          sampled: bool = False) -> list[int]:
    """Indices of the requests the neural drafter should draft for (see the module docstring); sampled: the
    batch samples, so its neural proposal drafts over every token and is priced so (`StepProfile.draft`)."""
    order = [r for r in sorted(range(len(copy)), key=lambda r: copy[r] - neural[r]) if neural[r] > copy[r]]
    if profile is None:  # no costs known: the larger expectation wins
        return sorted(order)
    tokens = len(copy) + sum(copy)
    batch = len(copy) + other + sum(copy)
    rows = len(copy) + (1 if other else 0)  # the decoding requests' rows, and the prefill's (one, at least)
    best, best_k = tokens / profile.cost(0, round(batch), sampled=sampled, rows=rows), 0
    for k, r in enumerate(order, 1):
        gain = neural[r] - copy[r]
        tokens, batch = tokens + gain, batch + gain
        theta = tokens / profile.cost(k, round(batch), sampled=sampled, rows=rows)
        if theta > best:  # every prefix is weighed (no early stop: nothing here was sampled this step), so
            best, best_k = theta, k  # a fixed cost of starting the neural drafter can pay off over many requests
    return sorted(order[:best_k])


class RoutedDrafter(Drafter):
    def __init__(self, neural: Drafter, copy: SuffixDrafter, smoothing: float = 0.5, probe_every: int = 8,
                 probe_max: int = 64, probes_per_step: int = 1, probe_budget: float = 0.01) -> None:
        if not neural.has_confidence:
            raise ValueError(f"routing needs the neural drafter's confidences; {neural.config.kind} has no head")
        self.neural, self.copy, self.smoothing = neural, copy, smoothing
        self._config = neural.config.replace(kind="auto")
        self.waiting = Waiting()  # context the neural drafter has not received
        self.expect: dict[str, float] = {}  # per request: smoothed survival sums of the neural drafter
        self.prior = neural.gamma / 2  # for requests it never drafted for (updated by all of them)
        self.blocks: dict[str, tuple[int, list[int], float]] = {}  # last neural block: (position of x_1, tokens, sum)
        self.kept, self.promised = 0.0, 0.0  # decayed sums behind kappa
        self.profile: StepProfile | None = None
        self.probe_every, self.probe_max, self.probes_per_step = probe_every, probe_max, probes_per_step
        self.probe_budget = probe_budget
        self.quiet = 0  # steps since the neural drafter last ran
        self.idle: dict[str, int] = {}  # per request: steps since the neural drafter last drafted for it
        self.interval: dict[str, int] = {}  # per request: steps between probes

    @property
    def config(self) -> DrafterConfig:
        return self._config

    @config.setter
    def config(self, value: DrafterConfig) -> None:  # build_engine's --gamma reaches both drafters
        self.neural.config = self.neural.config.replace(gamma=value.gamma)
        self.copy.config = self.copy.config.replace(gamma=value.gamma)
        self._config = self.neural.config.replace(kind="auto")

    @property
    def has_confidence(self) -> bool:
        return True

    @property
    def bursty(self) -> bool:
        return True  # half of it copies; and it weighs each request's own record itself (expect, kappa)

    @property
    def measured(self) -> Drafter:
        return self.neural.measured

    @property
    def splits_vocab(self) -> bool:
        return self.neural.splits_vocab

    def restrict_vocab(self, ids: Sequence[int] | None) -> None:
        """The neural drafter's draft vocabulary (`NeuralDrafter.restrict_vocab`); the copy drafter has no LM head."""
        self.neural.restrict_vocab(ids)

    def bind(self, target, num_blocks: int, block_size: int) -> None:
        self.neural.bind(target, num_blocks, block_size)
        self.copy.bind(target, num_blocks, block_size)

    def set_profile(self, profile: StepProfile | None) -> None:
        self.profile = profile

    def extend(self, rows: Sequence[ContextRow]) -> None:
        self.copy.extend(rows)
        self.waiting.add(rows)

    def hand_over(self, seq_ids: Sequence[str]) -> None:
        """The waiting context of these requests, merged into one row each, to the neural drafter."""
        self.neural.extend(self.waiting.take(seq_ids))

    def free(self, seq_id: str) -> None:
        self.waiting.drop(seq_id)
        self.blocks.pop(seq_id, None)
        self.expect.pop(seq_id, None)
        self.idle.pop(seq_id, None)
        self.interval.pop(seq_id, None)
        self.neural.free(seq_id)
        self.copy.free(seq_id)

    def cache_bytes_in_use(self) -> int:
        return self.neural.cache_bytes_in_use()

    def forget(self) -> None:
        self.copy.forget()

    @property
    def cuts_exactly(self) -> bool:
        """No: a copy proposal is whole at any depth, and the router weighs each request's neural expectation over
        the whole block. A gate that cut the neural proposals routed requests to a drafter it then starved: `auto` at
        16 agent requests ran 1.13x plain where the whole block ran 1.27x (`docs/results/online/gate-cut/`). A
        static:k policy still cuts the neural part (it proposes at the depth asked)."""
        return False

    def propose(self, inputs: Sequence[ProposeInput], rows: SamplingRows, depth: int | None = None) -> DraftBlock:
        block = self.copy.propose(inputs, rows)
        assert block.confidence is not None and block.num_valid is not None
        copy = expected_tokens(block.confidence, block.num_valid)
        for inp in inputs:
            self.judge(inp)
        neural = [self.kappa * self.expect.get(i.seq_id, self.prior) for i in inputs]
        chosen = self.explore(inputs, route(copy, neural, self.profile, sampled=not rows.all_greedy))
        sources = [self.copy.config.kind] * len(inputs)
        if chosen:
            picked = [inputs[r] for r in chosen]
            self.hand_over([i.seq_id for i in picked])
            nb = self.neural.propose(picked, rows.take(chosen), depth)
            assert nb.confidence is not None
            sums = expected_tokens(nb.confidence, nb.num_valid or [self.gamma] * len(picked))
            self.learn(picked, sums)
            for inp, toks, e in zip(picked, nb.tokens.tolist(), sums, strict=True):
                self.blocks[inp.seq_id] = (inp.context_len + 1, toks, e)
            index = torch.tensor(chosen, device=block.tokens.device)
            block.tokens[index] = nb.tokens.to(block.tokens.device)
            if nb.probs is not None:  # sampled rows: the copied ones' certain drafts as one-hots beside them
                block.probs = block.distributions(nb.probs.shape[-1])
                block.probs[index] = nb.probs.to(block.probs.device)
            block.confidence[index] = nb.confidence.to(block.confidence.device, torch.float32)
            for k, r in enumerate(chosen):
                block.num_valid[r] = self.gamma if nb.num_valid is None else nb.num_valid[k]
                sources[r] = self.neural.config.kind
        block.sources, block.num_drafted = sources, len(chosen)
        return block

    def explore(self, inputs: Sequence[ProposeInput], chosen: list[int]) -> list[int]:
        """`chosen` plus the probes due this step (see the module docstring); reads only step counts."""
        merit = set(chosen)
        due = []
        for r, inp in enumerate(inputs):
            sid = inp.seq_id
            if r in merit:
                self.idle[sid], self.interval[sid] = 0, self.probe_every
                continue
            self.idle[sid] = self.idle.get(sid, 0) + 1
            if self.idle[sid] >= self.interval.setdefault(sid, self.probe_every):
                due.append(r)
        self.quiet = 0 if merit else self.quiet + 1
        if not due or (not merit and self.quiet < self.probe_spacing(len(inputs))):
            return sorted(merit)
        probes = sorted(due, key=lambda r: -self.idle[inputs[r].seq_id])[: self.probes_per_step]
        for r in probes:
            sid = inputs[r].seq_id
            self.idle[sid], self.interval[sid] = 0, min(self.probe_max, 2 * self.interval[sid])
        self.quiet = 0
        return sorted(merit.union(probes))

    def probe_spacing(self, num_requests: int) -> int:
        """The fewest steps between probes that start the neural drafter for nobody else: a proposal
        for one request costs at most `probe_budget` of the plain steps between them (from the profile)."""
        if self.profile is None or not self.probe_budget:
            return 1
        return math.ceil(self.profile.draft(1) / (self.probe_budget * self.profile.plain(num_requests)))

    @property
    def kappa(self) -> float:
        return (self.kept + PRIOR_TOKENS) / (self.promised + PRIOR_TOKENS)

    def judge(self, inp: ProposeInput) -> None:
        """Fold the request's last neural block into kappa: its tokens that the request committed."""
        last = self.blocks.pop(inp.seq_id, None)
        seq = self.copy.seqs.get(inp.seq_id)
        if last is None or seq is None:
            return
        start, tokens, promised = last
        kept = 0
        for k, tok in enumerate(tokens):
            pos = start + k
            truth = seq.tokens[pos] if pos < len(seq.tokens) else inp.anchor if pos == len(seq.tokens) else None
            if truth != tok:
                break
            kept += 1
        self.kept, self.promised = 0.98 * self.kept + kept, 0.98 * self.promised + promised

    def learn(self, inputs: Sequence[ProposeInput], sums: Sequence[float]) -> None:
        a = self.smoothing
        for inp, e in zip(inputs, sums, strict=True):
            old = self.expect.get(inp.seq_id)
            self.expect[inp.seq_id] = e if old is None else (1 - a) * old + a * e
            self.prior = 0.9 * self.prior + 0.1 * e

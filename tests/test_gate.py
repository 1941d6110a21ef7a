"""The never-slower gate: closed when the profile and the acceptance seen so far say drafting
loses, open when it pays, probing at doubling intervals while closed, and its cached verdict
follows new acceptance statistics at once and a drifting profile within `recheck_every` steps."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dspark.engine.gate import Gate, GateConfig
from dspark.spec.policies import algorithm1, candidates
from dspark.spec.profile import StepProfile
from dspark.spec.stats import AcceptanceStats

GAMMA = 4


def profile(draft_s: float) -> StepProfile:
    """A flat verify cost (memory-bound target): drafting pays exactly when drafts are cheap and accepted."""
    return StepProfile("test", tokens=[1, 8, 64], verify_s=[0.01, 0.01, 0.01], requests=[1, 8], draft_s=[draft_s] * 2)


def stats(accept: bool, rounds: int = 200) -> AcceptanceStats:
    s = AcceptanceStats(GAMMA)
    for _ in range(rounds):
        s.update([GAMMA], [GAMMA if accept else 0])
    return s


def test_closed_gate_probes_at_doubling_intervals():
    gate = Gate(GateConfig(probe_every=2, probe_max=8, probe_budget=0, explore_budget=0), stats(accept=False), profile(draft_s=0.05))
    calls = [(gate.should_draft(1, [GAMMA]), gate.probing) for _ in range(40)]
    assert [i for i, (d, _) in enumerate(calls) if d] == [1, 5, 13, 21, 29, 37]  # waits 2, 4, 8, 8 (the cap)
    assert all(d == p for d, p in calls)  # every opening is a probe


def test_open_gate_drafts_every_step():
    gate = Gate(GateConfig(), stats(accept=True), profile(draft_s=0.001))
    assert all(gate.should_draft(4, [GAMMA] * 4) for _ in range(50))
    assert not gate.probing


def test_verdict_follows_new_acceptance_immediately():
    s = stats(accept=False)
    gate = Gate(GateConfig(probe_every=1000), s, profile(draft_s=0.001))
    assert not gate.should_draft(1, [GAMMA])
    for _ in range(400):
        s.update([GAMMA], [GAMMA])
    assert gate.should_draft(1, [GAMMA])


def test_verdict_follows_a_drifting_profile_within_recheck_every():
    prof = profile(draft_s=0.05)
    gate = Gate(GateConfig(probe_every=1000, recheck_every=4), stats(accept=True), prof)
    assert not gate.should_draft(1, [GAMMA])
    prof.draft_s = [0.001, 0.001]  # e.g. the online correction found drafting cheaper
    verdicts = [gate.should_draft(1, [GAMMA]) for _ in range(4)]
    assert verdicts[-1] and not verdicts[0]


def test_a_new_batch_shape_is_judged_afresh():
    prof = StepProfile("test", tokens=[1, 8, 64], verify_s=[0.01, 0.01, 0.16], requests=[1, 64], draft_s=[0.001] * 2)
    gate = Gate(GateConfig(probe_every=1000), stats(accept=True), prof)
    assert gate.should_draft(1, [GAMMA])  # verifying is free at batch 1 (memory-bound)
    assert not gate.should_draft(64, [GAMMA] * 64)  # compute-bound: extra tokens cost their full price
    assert gate.should_draft(1, [GAMMA])


def test_a_one_request_profile_is_constant_past_its_point():
    """A profile measured by a one-request engine (e.g. `bench peers`) has a one-point request
    grid; reading it at 16 requests must not divide by zero inside the engine loop."""
    prof = StepProfile("test", tokens=[1, 8], verify_s=[0.01, 0.02], requests=[1], draft_s=[0.005])
    assert prof.draft(16) == 0.005 and prof.cost(16, 32) > 0
    gate = Gate(GateConfig(), stats(accept=False), prof)
    gate.should_draft(16, [GAMMA] * 16)


def test_profile_key_separates_engine_shapes():
    from dspark.engine.profiler import profile_key

    one = profile_key("m", "dspark:7", "cpu", "float32", 7, 2048, 1)
    assert one != profile_key("m", "dspark:7", "cpu", "float32", 7, 2048, 64)
    assert one == profile_key("m", "dspark:7", "cpu", "float32", 7, 2048, 1)


def test_a_prefill_step_does_not_open_a_closed_gate():
    """With a long prefill in the batch the forward is slow anyway and a few draft tokens look
    free; the gate still judges decoding alone (opening would draft for every request, each
    catching up its pending context), so it stays closed and the probe backoff keeps growing."""
    prof = StepProfile("test", tokens=[1, 1001], verify_s=[0.011, 1.011], requests=[1, 8], draft_s=[0.02, 0.02])
    gate = Gate(GateConfig(probe_every=2, probe_max=64, judge_after=0, optimism=0.0), AcceptanceStats(GAMMA), prof)  # prior c = 0.5
    for _ in range(20):
        gate.should_draft(1, [GAMMA])
    grown = gate.interval
    assert grown > 2
    cands = candidates(torch.tensor([gate.stats.conditional()]), [GAMMA])
    assert algorithm1(cands, 1, 1000, prof.cost) > 0  # with the prefill counted, drafting would look free
    gate.wait = 0
    assert not gate.should_draft(1, [GAMMA]) and not gate.probing
    assert gate.interval == grown


def test_expensive_probes_are_spaced_to_fit_the_probe_budget():
    """A probe costing 5 plain steps more than a plain step, with a 1% budget, waits 500 steps
    (past probe_max, below the ceiling); cheap probes keep probe_max; the ceiling holds."""
    cfg = GateConfig(probe_every=2, probe_max=8, probe_budget=0.01, probe_ceiling=1000, explore_budget=0)
    gate = Gate(cfg, stats(accept=False), profile(draft_s=0.05))
    assert gate.longest_interval(1) == 500
    calls = [gate.should_draft(1, [GAMMA]) for _ in range(1200)]
    assert [i for i, d in enumerate(calls) if d][:9] == [1, 5, 13, 29, 61, 125, 253, 509, 1009]
    assert Gate(cfg, stats(accept=False), profile(draft_s=0.0001)).longest_interval(1) == 8
    assert Gate(GateConfig(probe_budget=0.0001, probe_ceiling=1000), stats(accept=False),
                profile(draft_s=0.05)).longest_interval(1) == 1000


def test_early_probes_fit_the_explore_budget():
    """While the interval doubles, a probe costing 5 plain steps extra waits at least 5 / 2% =
    250 steps for the next one (not 4, 8, 16, ...); the first probe still comes after
    probe_every steps, and probe_max / the probe budget still bound the interval from above."""
    cfg = GateConfig(probe_every=2, probe_max=64, probe_budget=0.01, probe_ceiling=1000, explore_budget=0.02)
    gate = Gate(cfg, stats(accept=False), profile(draft_s=0.05))
    assert gate.probe_cost(1) == pytest.approx(5.0) and gate.shortest_interval(1) == 250
    calls = [gate.should_draft(1, [GAMMA]) for _ in range(1300)]
    assert [i for i, d in enumerate(calls) if d][:4] == [1, 251, 751, 1251]  # waits 2, 250, 500, 500 (the budget)
    cheap = Gate(cfg, stats(accept=False), profile(draft_s=0.001))  # a probe adds 0.1 step: at least 5 apart
    calls = [cheap.should_draft(1, [GAMMA]) for _ in range(40)]
    assert [i for i, d in enumerate(calls) if d] == [1, 6, 16, 36]  # waits 2, 5 (not 4), then doubling: 10, 20


def test_a_probe_drafts_for_a_rotating_few():
    gate = Gate(GateConfig(probe_requests=2), stats(accept=False), profile(draft_s=0.05))  # a profile that cannot cut
    decode = list("abcde")
    assert gate.probe_subset(decode, 0) == ["a", "b"]
    assert gate.probe_subset(decode, 4) == ["e", "a"]
    assert gate.probe_subset(decode[:2], 7) == ["a", "b"]


def test_a_closed_gate_withholds_draft_slots_between_probes():
    """The engine loop: slots are reserved only when the gate may draft (open, or a probe due);
    the probe cadence is the same as when every step had slots."""
    gate = Gate(GateConfig(probe_every=2, probe_max=8, probe_budget=0, explore_budget=0), stats(accept=False), profile(draft_s=0.05))
    drafted, with_slots = [], []
    for i in range(40):
        if gate.wants_slots():
            with_slots.append(i)
            if gate.should_draft(1, [GAMMA]):
                drafted.append(i)
        else:
            gate.withheld(1, GAMMA)
    assert drafted == [1, 5, 13, 21, 29, 37]
    assert with_slots == [0, *drafted]  # the first step (no verdict yet), then only the probes


def test_the_online_correction_scales_every_batch_shape_alike():
    """Serving observes plain one-token steps all the time and drafted shapes rarely; a machine
    1.5x slower than at start-up must raise the cost of both, the drafter's included, or
    drafting looks cheap. Drafted steps correct the drafted cost on top of the machine's scale."""
    prof = StepProfile("test", tokens=[1, 8, 64], verify_s=[0.01, 0.012, 0.03], requests=[1, 8], draft_s=[0.006] * 2)
    before = prof.verify(1), prof.verify(8), prof.draft(1)
    for _ in range(200):
        prof.observe_plain(1, 0.015)
    after = prof.verify(1), prof.verify(8), prof.draft(1)
    assert abs(after[0] / before[0] - 1.5) < 0.01 and abs(after[1] / before[1] - 1.5) < 0.01
    assert abs(after[2] / before[2] - 1.5) < 0.01  # the drafter runs on the same, slower machine
    prof.observe_drafted(1, 8, 0.027)  # a drafted step as slow as the machine predicts: nothing to correct
    assert abs(prof.spec_scale - 1.0) < 1e-3
    prof.observe_drafted(1, 8, 0.27)  # one drafted step 10x slow (a new shape's first forward): clipped at 2x
    assert prof.cost(1, 8) > after[1] + after[2] and prof.spec_scale <= 1 + prof.smoothing + 1e-5
    cached = StepProfile.from_json(prof.to_json())
    assert cached.cost(1, 8) == prof.cost(1, 8)
    assert prof.draft(0.25) == 0.25 * prof.draft(1)  # a router's share of requests: a run in that share of steps


def test_drafted_steps_slower_than_profiled_close_the_gate():
    """The start-up profile says verifying 8 tokens costs 1.14 plain steps and a proposal 0.25:
    with acceptance ~0.4 at the first position drafting looks like a win. The engine's drafted steps
    really take 1.8 plain steps (host work the raw forward timings do not see); once the
    drafted steps are observed, the gate must close, since plain steps now win."""
    s = AcceptanceStats(GAMMA)
    for _ in range(60):
        for n in [0] * 6 + [1] * 3 + [2]:
            s.update([GAMMA], [n])
    prof = StepProfile("test", tokens=[1, 8, 64], verify_s=[0.02, 0.0228, 0.06], requests=[1, 8],
                       draft_s=[0.005] * 2)
    gate = Gate(GateConfig(probe_every=10**6, caution=0.0), s, prof)
    assert gate.predict(1, [GAMMA])
    for _ in range(100):
        prof.observe_plain(1, 0.02)
        prof.observe_drafted(1, 8, 0.036)
    assert 1.2 < prof.spec_scale < 1.4
    assert not gate.predict(1, [GAMMA])


def test_a_machine_slowed_by_a_neighbour_does_not_open_the_gate():
    """Acceptance ~0.5 per position: drafting loses at the profiled speeds. The machine then runs
    2x slower (plain steps observe it); drafting slows as much, so the verdict stays closed. Had
    the drafter's curve kept its start-up cost, the same steps would have opened it."""
    s = AcceptanceStats(GAMMA)
    for _ in range(40):
        for n in [0] * 8 + [1] * 4 + [2] * 2 + [3, 4]:
            s.update([GAMMA], [n])
    prof = StepProfile("test", tokens=[1, 8, 64], verify_s=[0.01] * 3, requests=[1, 8], draft_s=[0.012] * 2)
    gate = Gate(GateConfig(probe_every=10**6), s, prof)
    assert not gate.predict(1, [GAMMA])
    for _ in range(300):
        prof.observe_plain(1, 0.02)
    assert not gate.predict(1, [GAMMA])
    prof.spec_scale = 0.75  # drafted steps observed faster than their prediction ...
    assert gate.predict(1, [GAMMA])  # ... are what may open it


def slowed_spell(prof: StepProfile, timed_forward: bool) -> None:
    """The machine runs 1.5x slower than at start-up while the gate is open (drafted steps only: a
    request's forward of 5 tokens, drafts included, and its proposal, each 1.5x their profile), then
    closes and takes plain steps, as slow. `timed_forward`: the engine times the forward inside steps."""
    fwd = 1.5 * prof.verify_s[0]  # the profile's forward is flat from 1 to 8 tokens
    for _ in range(200):
        prof.observe_drafted(1, 5, fwd + 1.5 * prof.draft_s[0], forward=fwd if timed_forward else None)
    for _ in range(200):
        prof.observe_plain(1, fwd, forward=fwd if timed_forward else None)


@pytest.mark.parametrize("timed_forward", [True, False])
def test_a_slow_spell_seen_while_drafting_is_not_counted_twice_once_closed(timed_forward):
    """Drafting pays at the profiled costs; a slowdown of the whole machine does not change that. Timing
    the forward inside drafted steps keeps the machine scale fresh while the gate is open, so the drafted
    correction stays near 1 and the verdict stays open after the plain steps. Without it (the control),
    the drafted correction takes in the slowdown, the plain steps then raise the machine scale as well,
    and drafting is priced 1.5 x 1.5 times its profile: the gate closes where drafting still pays."""
    s = AcceptanceStats(GAMMA)
    for _ in range(60):
        for n in [0] * 6 + [1] * 3 + [2]:  # half a token gained per drafted step: pays at 1.2 plain steps, not 1.8
            s.update([GAMMA], [n])
    prof = StepProfile("test", tokens=[1, 8, 64], verify_s=[0.02, 0.02, 0.05], requests=[1, 8], draft_s=[0.004] * 2)
    gate = Gate(GateConfig(probe_every=10**6, caution=0.0), s, prof)
    assert gate.predict(1, [GAMMA])
    slowed_spell(prof, timed_forward)
    if timed_forward:
        assert abs(prof.verify_scale - 1.5) < 0.01 and abs(prof.spec_scale - 1.0) < 0.01
        assert abs(prof.plain_scale - 1.0) < 0.01 and gate.predict(1, [GAMMA])
    else:
        assert prof.spec_scale > 1.4 and abs(prof.verify_scale - 1.5) < 0.01 and not gate.predict(1, [GAMMA])


def test_plain_steps_host_work_is_priced_on_top_of_their_forward():
    prof = StepProfile("test", tokens=[1, 8], verify_s=[0.02, 0.03], requests=[1, 8], draft_s=[0.004] * 2)
    for _ in range(300):
        prof.observe_plain(1, 0.024, forward=0.02)  # the forward as profiled, 4 ms of host work around it
    assert abs(prof.verify_scale - 1.0) < 1e-3 and abs(prof.plain_scale - 1.2) < 1e-3
    assert abs(prof.verify(1) - 0.024) < 1e-4 and abs(prof.draft(1) - 0.004) < 1e-6  # the drafter: machine only


def test_a_profile_cached_with_per_bucket_corrections_still_loads():
    import json

    raw = json.loads(StepProfile("old", tokens=[1, 8], verify_s=[0.01, 0.02]).to_json())
    raw.pop("verify_scale"), raw.pop("spec_scale")
    raw.update(verify_fix={"0": 1.3}, draft_fix={}, extra_seen=[[0.001]])  # an older and a newer version's keys
    assert StepProfile.from_json(json.dumps(raw)).verify(1) == 0.01


def test_untried_positions_follow_the_position_before_them():
    """Hostile traffic rejects position 1 and never tries the deep ones: their estimates must
    not stay at the prior 0.5 (that made the gate open on survival it had never seen)."""
    s = AcceptanceStats(GAMMA)
    for _ in range(100):
        s.update([GAMMA], [0])  # position 1 tried and rejected; 2..GAMMA never tried
    c = s.conditional()
    assert c[0] < 0.05 and all(abs(x - c[0]) < 1e-9 for x in c[1:])
    assert s.observed()[1:] == [None] * (GAMMA - 1)


def test_lower_estimates_tighten_with_evidence():
    few, many = AcceptanceStats(GAMMA), AcceptanceStats(GAMMA)
    few.update([GAMMA] * 2, [GAMMA] * 2)
    for _ in range(300):
        many.update([GAMMA], [GAMMA - 1])
    for s in (few, many):
        assert all(lo < c for lo, c in zip(s.lower(), s.conditional(), strict=True))
    gap = lambda s: s.conditional()[0] - s.lower()[0]  # noqa: E731
    assert gap(many) < 0.05 < gap(few)


def test_a_few_lucky_probes_do_not_open_the_gate():
    """Two probe requests that accepted everything are not evidence enough to draft for every
    request; the same acceptance over many observations is."""
    prof = StepProfile("test", tokens=[1, 8, 64], verify_s=[0.01, 0.012, 0.03], requests=[1, 8], draft_s=[0.015] * 2)
    lucky = AcceptanceStats(GAMMA)
    lucky.update([GAMMA] * 2, [GAMMA] * 2)
    steady = AcceptanceStats(GAMMA)
    for _ in range(100):
        steady.update([GAMMA] * 2, [GAMMA] * 2)
    assert algorithm1(candidates(torch.tensor([lucky.conditional()] * 4), [GAMMA] * 4), 4, 0, prof.cost) > 0  # trusting it: open
    cautious = GateConfig(probe_every=1000, judge_after=0, caution=1.0, optimism=0.0)
    assert not Gate(cautious, lucky, prof).should_draft(4, [GAMMA] * 4)
    assert Gate(cautious, steady, prof).should_draft(4, [GAMMA] * 4)


def test_the_gate_is_cautious_only_after_enough_verified_drafts():
    """A fresh engine knows nothing of its drafter's acceptance: judged on the prior less its
    standard error the gate closed on the first step and never gathered evidence to reopen.
    Until judge_after first positions were verified it takes the estimates at face value: a
    drafter that pays at the prior is tried, one that could not is not."""
    prof = StepProfile("test", tokens=[1, 8, 64], verify_s=[0.01, 0.012, 0.03], requests=[1, 8], draft_s=[0.004] * 2)
    s = AcceptanceStats(GAMMA)
    cautious = GateConfig(probe_every=1000, judge_after=16, caution=1.0, optimism=0.0)
    gate = Gate(cautious, s, prof)
    assert gate.should_draft(1, [GAMMA])  # the prior, 0.5 per position, pays at this profile
    assert not Gate(replace(cautious, judge_after=0), AcceptanceStats(GAMMA), prof).should_draft(1, [GAMMA])
    for _ in range(16):
        s.update([GAMMA], [0] if _ % 2 else [1])  # half the first positions accepted, none after
    assert not gate.should_draft(1, [GAMMA])  # judged now, cautiously: drafting loses
    costly = StepProfile("test", tokens=[1, 8, 64], verify_s=[0.01, 0.012, 0.03], requests=[1, 8], draft_s=[0.05] * 2)
    assert not Gate(cautious, AcceptanceStats(GAMMA), costly).should_draft(1, [GAMMA])


def test_a_noisy_profile_point_takes_the_value_after_it():
    """Noise only adds time: a one-token forward timed slower than a two-token one was disturbed,
    and left so it made verifying drafts look cheaper than plain decoding at one request."""
    prof = StepProfile("test", tokens=[1, 2, 4, 8], verify_s=[0.0108, 0.0082, 0.0091, 0.0090],
                       requests=[1, 2], draft_s=[0.008, 0.007])
    assert prof.verify_s == [0.0082, 0.0082, 0.0090, 0.0090]
    assert prof.draft_s == [0.007, 0.007]
    assert all(prof.verify(b) <= prof.verify(b + 1) for b in range(1, 12))


def test_a_router_that_rarely_runs_its_costly_drafter_keeps_the_gate_open():
    """Drafts that are accepted but cost more than they save when the neural drafter runs for every
    request; a router that sends few requests to it (the copy drafter is free) makes them pay."""
    gate = Gate(GateConfig(), stats(accept=True), profile(draft_s=0.05))
    assert not gate.should_draft(4, [GAMMA] * 4)
    for _ in range(60):
        gate.observe_share(0, 4)
    gate.memo = None
    assert gate.draft_share < 0.01 and gate.should_draft(4, [GAMMA] * 4)


def test_a_request_whose_drafts_fail_is_judged_by_its_own_record():
    """Everyone else's drafts are accepted; one request's never are (a prompt unlike the drafter's
    training). Alone, that request decodes plainly after a few failed rounds, while a request with
    no record yet, or a good one, is still judged by everyone's."""
    gate = Gate(GateConfig(probe_every=1000), stats(accept=True), profile(draft_s=0.008))
    bad, good = AcceptanceStats(GAMMA), AcceptanceStats(GAMMA)
    assert gate.should_draft(1, [GAMMA], [bad])  # no record yet: everyone's
    for _ in range(40):  # enough that its record's upper bound (optimism) is low too
        bad.update([GAMMA], [0])
        good.update([GAMMA], [GAMMA])
    gate.stats.update([GAMMA], [GAMMA])  # a new round somewhere (records change with the shared version)
    assert not gate.should_draft(1, [GAMMA], [bad])
    assert gate.should_draft(1, [GAMMA], [None]) and gate.should_draft(1, [GAMMA], [good])
    assert gate.should_draft(2, [GAMMA] * 2, [bad, good])  # the good one's gain pays for both
    assert Gate(GateConfig(probe_every=1000, own_weight=0), stats(accept=True), profile(draft_s=0.008)).should_draft(
        1, [GAMMA], [bad])  # own_weight 0: everyone's record alone


def test_blend_shrinks_a_request_record_toward_everyone_elses_estimates():
    from dspark.spec.stats import blend

    shared = AcceptanceStats(GAMMA)
    for _ in range(200):
        shared.update([GAMMA], [2])  # everyone else: positions 1-2 accepted, 3 rejected
    assert blend(None, shared, 4.0) is shared
    own = AcceptanceStats(GAMMA)
    for _ in range(4):
        own.update([GAMMA], [0])  # position 1 tried 4 times, never accepted; later positions never tried
        shared.update([GAMMA], [0])  # the engine records a request's rounds in everyone's record too
    mixed = blend(own, shared, 4.0).conditional()
    assert mixed[0] == pytest.approx(0.5, abs=0.02)  # (0 + 4 * ~1 + 2 * 0.5) / (4 + 4 + 2): its own four counted once
    assert mixed[0] < mixed[1] < shared.conditional()[1] and mixed[2] < 0.3  # the others' shape, shrunk toward it
    assert blend(own, shared, 0.0) is shared
    assert blend(own, shared, 4.0).lower(-1.0)[0] > mixed[0] + 0.1  # the upper bound: ten observations' worth


def test_a_request_alone_in_everyones_record_is_not_counted_twice():
    """One request on a fresh engine: everyone's record is its own, and nothing else is left."""
    from dspark.spec.stats import blend

    shared, own = AcceptanceStats(GAMMA), AcceptanceStats(GAMMA)
    for _ in range(2):
        for s in (shared, own):
            s.update([GAMMA], [0])
    rest = shared.without(own)
    assert rest.tried == [0.0] * GAMMA and rest.accepted == [0.0] * GAMMA
    assert blend(own, shared, 4.0).conditional() == pytest.approx(shared.conditional())  # 0.25 at every position


def test_two_rejected_first_positions_do_not_end_drafting_on_a_fresh_engine():
    """The README's first command: one request, a drafter whose first position is accepted about
    half the time, and its first two drafts rejected (a one-in-four event). Judged at face value the
    gate closed there for the rest of the request; with the estimates' upper bound it keeps drafting,
    and a request whose drafts keep failing is still closed within a few more rounds."""
    prof = StepProfile("test", tokens=[1, 8, 64], verify_s=[0.01, 0.013, 0.03], requests=[1, 8], draft_s=[0.003] * 2)
    shared, own = AcceptanceStats(GAMMA), AcceptanceStats(GAMMA)
    for _ in range(2):
        for s in (shared, own):
            s.update([GAMMA], [0])
    assert Gate(GateConfig(probe_every=1000), shared, prof).should_draft(1, [GAMMA], [own])
    assert not Gate(GateConfig(probe_every=1000, optimism=0.0), shared, prof).should_draft(1, [GAMMA], [own])
    for _ in range(8):
        for s in (shared, own):
            s.update([GAMMA], [0])
    assert not Gate(GateConfig(probe_every=1000), shared, prof).should_draft(1, [GAMMA], [own])


def half_accepted(rounds: int = 400) -> AcceptanceStats:
    """Every position accepted half the time: survival 0.5, 0.25, 0.125, ..."""
    s = AcceptanceStats(GAMMA)
    for i in range(rounds):
        s.update([GAMMA], [[0, 1, 2, 4][i % 4]])  # conditional rates 3/4, 2/3, 1/2: falling, like a real drafter
    return s


def loaded_profile(shallow: bool = True) -> StepProfile:
    """A target that turns compute-bound with the batch, and a drafter whose full block costs four times
    a one-position proposal for many requests (a causal block), the same for one request."""
    return StepProfile("test", tokens=[1, 8, 64, 512], verify_s=[0.010, 0.011, 0.030, 0.120], requests=[1, 64],
                       draft_s=[0.002, 0.040], gamma=GAMMA, shallow_s=[0.002, 0.004] if shallow else [])


def test_profile_prices_a_shallower_proposal_between_one_position_and_the_full_block():
    prof = loaded_profile()
    assert prof.cuts and prof.draft(64, 1) == pytest.approx(0.004) and prof.draft(64, GAMMA) == pytest.approx(0.040)
    assert prof.draft(64, 2) == pytest.approx(0.016) and prof.draft(64) == pytest.approx(0.040)
    flat = loaded_profile(shallow=False)
    assert not flat.cuts and flat.draft(64, 1) == pytest.approx(0.040)  # not measured: every depth costs a full block
    # an early exit: one position below the line, two and more on the line from two positions to the full block
    exited = replace(prof, shallow_s=[0.001, 0.002], pair_s=[0.002, 0.010])
    assert exited.draft(64, 1) == pytest.approx(0.002) and exited.draft(64, 2) == pytest.approx(0.010)
    assert exited.draft(64, 3) == pytest.approx(0.010 + 0.030 * (3 - 2) / (GAMMA - 2))
    assert exited.draft(64) == pytest.approx(0.040)


def test_gate_drafts_the_whole_block_for_one_request_and_one_position_under_load():
    gate = Gate(GateConfig(optimism=0.0, cut=True), half_accepted(), loaded_profile())
    assert gate.should_draft(1, [GAMMA]) and gate.depth == GAMMA
    gate.memo = None
    assert gate.should_draft(64, [GAMMA] * 64) and gate.depth == 1
    # the same drafter priced as one that cannot cut, or a gate that does not cut: under load the full block does
    # not pay at all
    for gate in (Gate(GateConfig(optimism=0.0), half_accepted(), loaded_profile(shallow=False)),
                 Gate(GateConfig(optimism=0.0, cut=False), half_accepted(), loaded_profile())):
        assert not gate.should_draft(64, [GAMMA] * 64)


def test_a_deeper_block_must_win_by_the_margin():
    """The shallowest block whose rate is within depth_margin of the best is drafted: the estimates of deep positions
    come from the rounds the policy verified that deep, and a deep proposal for many requests costs more than the
    profile's line says."""
    prof = StepProfile("test", tokens=[1, 8], verify_s=[0.010, 0.010], requests=[1], draft_s=[0.0011], gamma=GAMMA,
                       shallow_s=[0.0010])  # rates by depth: 159, 204, 226, 248 tokens/s; plain 100
    for margin, depth in ((0.0, GAMMA), (0.05, GAMMA), (0.2, 2), (0.5, 1)):
        assert Gate(GateConfig(optimism=0.0, cut=True, depth_margin=margin), half_accepted(), prof).predict(1, [GAMMA]) == depth


def test_under_load_a_probe_drafts_one_position_for_every_request():
    """Where the gate picks the depth, a probe among more requests than a narrow one takes drafts one position for
    all of them (it learns the first position's acceptance from every one, in the shape an open gate drafts), and
    is priced so; without cut, or among as few requests as a narrow probe takes, it drafts the whole block for a
    rotating few."""
    broad = Gate(GateConfig(probe_requests=2), stats(accept=False), loaded_profile())
    decode = list("abcde")
    assert broad.broad(5) and broad.probe_subset(decode, 3) == decode and broad.probe_depth(5) == 1
    prof = loaded_profile()
    plain = prof.plain(64)
    assert broad.probe_cost(64) == pytest.approx((prof.cost(64, 128, 1, rows=64) - plain) / plain)
    assert not broad.broad(2) and broad.probe_subset(decode[:2], 1) == ["a", "b"] and broad.probe_depth(2) is None
    for narrow in (Gate(GateConfig(probe_requests=2, cut=False), stats(accept=False), loaded_profile()),
                   Gate(GateConfig(probe_requests=2), stats(accept=False), loaded_profile(shallow=False)),
                   Gate(GateConfig(probe_requests=2), stats(accept=False), loaded_profile(), cuts=False)):
        assert not narrow.broad(5) and narrow.probe_subset(decode, 4) == ["e", "a"] and narrow.probe_depth(5) is None
        assert narrow.probe_cost(64) == pytest.approx((prof.cost(2, 66, rows=64) - plain) / plain)
        narrow.probing = True
        assert narrow.step_depth(5, None) is None and narrow.step_depth(5, 3) == 3  # the policy's deepest
    # the step drafts a probe's depth while probing, else the verdict's
    broad.probing, broad.depth = True, 4
    assert broad.step_depth(5, None) == 1 and broad.step_depth(5, 3) == 1
    broad.probing = False
    assert broad.step_depth(5, None) == 4


def test_a_one_position_drafter_probes_every_request_under_load():
    """A drafter whose block is one position (MTP-1) has no depth to pick, and a probe of that position for every
    request is its whole block: under load it probes broadly, priced so; among as few requests as a narrow probe
    takes, it drafts for them."""
    prof = StepProfile("test", tokens=[1, 8, 64, 512], verify_s=[0.010, 0.011, 0.030, 0.120], requests=[1, 64],
                       draft_s=[0.001, 0.004], gamma=1)
    rejected = AcceptanceStats(1)
    for _ in range(50):
        rejected.update([1], [0])
    gate = Gate(GateConfig(probe_requests=2), rejected, prof, cuts=True)
    decode = list("abcde")
    assert not gate.picks_depth and gate.broad(5) and gate.probe_subset(decode, 3) == decode
    assert gate.probe_depth(5) == 1 and not gate.broad(2) and gate.probe_subset(decode[:2], 1) == ["a", "b"]
    plain = prof.plain(64)
    assert gate.probe_cost(64) == pytest.approx((prof.cost(64, 128, 1, rows=64) - plain) / plain)
    wide = Gate(GateConfig(probe_requests=2), stats(accept=False), loaded_profile(shallow=False), cuts=True)
    assert not wide.broad(5)  # a block of four positions, none cut: a narrow probe of the whole block


def test_probes_priced_by_what_they_were_measured_to_cost():
    """The profile prices a probe at 0.1 plain steps (at least 5 steps apart at a 2% explore budget); one
    measured at 3 plain steps beyond a plain one stretches the wait to 3 / 2% = 150 steps, and the
    measurements are averaged, so a later cheap probe brings the wait back down."""
    cfg = GateConfig(probe_every=2, probe_max=64, probe_budget=0.01, probe_ceiling=1000, explore_budget=0.02)
    gate = Gate(cfg, stats(accept=False), profile(draft_s=0.001))
    assert gate.probe_cost(1) == pytest.approx(0.1) and gate.shortest_interval(1) == 5
    calls = [gate.should_draft(1, [GAMMA]) for _ in range(3)]
    assert calls == [False, True, False] and gate.interval == 5
    gate.observe_probe(1, 0.04)  # the plain step costs 0.01 s: this probe cost 3 more
    assert gate.probe_cost(1) == pytest.approx(3.0) and gate.interval == 150
    assert gate.longest_interval(1) == 300  # 3 / 1%
    gate.observe_probe(1, 0.01)  # a probe that cost no more than a plain step
    assert gate.probe_cost(1) == pytest.approx(1.5)
    Gate(cfg, stats(accept=False), None).observe_probe(1, 0.04)  # no profile: nothing to price by


def test_a_batch_that_samples_is_priced_with_its_wider_proposal():
    """Where sampling batches draft over every token and greedy ones over a draft vocabulary, the profile
    adds the wider proposal's extra cost per position drafted, and the gate judges each kind of batch by it."""
    prof = StepProfile("test", tokens=[1, 8], verify_s=[0.010, 0.010], requests=[1, 8], draft_s=[0.002, 0.004],
                       gamma=GAMMA, sampled_s=[0.006, 0.012])
    assert prof.draft(1) == pytest.approx(0.002) and prof.draft(1, sampled=True) == pytest.approx(0.006)
    assert prof.draft(8, sampled=True) == pytest.approx(0.012)
    assert prof.cost(1, 5, sampled=True) == pytest.approx(0.016)
    cut = replace(prof, shallow_s=[0.001, 0.002])
    assert cut.draft(1, 2, sampled=True) == pytest.approx(0.001 + 0.001 / 3 + 0.004 * 2 / GAMMA)
    assert replace(prof, sampled_s=[0.001, 0.001]).sampled_s == [0.002, 0.004]  # never below the greedy proposal
    costly = replace(prof, draft_s=[0.001, 0.001], sampled_s=[0.050, 0.050])
    gate = Gate(GateConfig(probe_every=1000), stats(accept=True), costly)
    assert gate.should_draft(1, [GAMMA])
    assert not gate.should_draft(1, [GAMMA], sampled=True)  # judged afresh, not the greedy verdict remembered
    assert gate.should_draft(1, [GAMMA])


def test_ladder_prices_every_small_size_then_about_one_and_a_half_apart():
    from dspark.engine.gate import ladder

    assert ladder(1) == [1] and ladder(5) == [1, 2, 3, 4, 5] and ladder(0) == []
    assert ladder(64) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 18, 27, 41, 62, 64]


def test_the_gate_drafts_only_for_the_requests_whose_records_pay():
    """16 requests, a proposal that costs in proportion to the requests drafted for, verification that is
    free: drafting for all 16 loses (12 of them never see a draft accepted), drafting for the four whose
    drafts are accepted pays."""
    prof = StepProfile("test", tokens=[1, 16, 128], verify_s=[0.01] * 3, requests=[1, 16], draft_s=[0.001, 0.016])
    good, bad = stats(accept=True), stats(accept=False)
    everyone = AcceptanceStats(GAMMA)
    for _ in range(50):
        everyone.update([GAMMA] * 4, [GAMMA, 0, 0, 0])
    own = [good if i % 4 == 1 else bad for i in range(16)]
    verdict = Gate(GateConfig(select=True), everyone, prof).decide(16, [GAMMA] * 16, own)
    assert verdict.depth == GAMMA and verdict.rows == (1, 5, 9, 13)
    assert Gate(GateConfig(), everyone, prof).decide(16, [GAMMA] * 16, own).depth == 0  # off by default: all or none
    gate = Gate(GateConfig(select=True), everyone, prof)
    assert gate.should_draft(16, [GAMMA] * 16, own) and not gate.probing
    assert gate.chosen(list("abcdefghijklmnop")) == ["b", "f", "j", "n"]


def test_undrafted_requests_in_the_forward_make_algorithm1_admit_less():
    """Each decoding request emits a token whatever is drafted; counting the ones not drafted for makes a
    verified draft token worth less of the step, so fewer are admitted."""
    cost = lambda r, b: 1.0 + 0.1 * b  # noqa: E731
    cands = candidates(torch.tensor([[0.3] * GAMMA]), [GAMMA])
    assert algorithm1(cands, 1, 0, cost) >= 1
    assert algorithm1(cands, 1, 0, cost, plain_rows=15) == 0


def test_gate_options_parse_into_a_config_and_bad_ones_are_named():
    assert GateConfig.parse("") == GateConfig()
    assert GateConfig.parse("select=0, probe_every=4,optimism=0.5") == replace(
        GateConfig(), select=False, probe_every=4, optimism=0.5)
    assert GateConfig.parse("cut=true").cut
    for bad, said in (("selekt=0", "KEY one of"), ("select=2", "not a bool"), ("probe_every=x", "not an int"),
                      ("select", "KEY=VALUE")):
        with pytest.raises(ValueError, match=said):
            GateConfig.parse(bad)


def test_gate_options_reach_the_engine_from_llm_and_the_command_line(qwen3_dir, capsys):
    from dspark import LLM
    from dspark.cli import main

    assert LLM(qwen3_dir, drafter="ngram", policy="dspark", gate="cut=1", device="cpu").engine.runner.gate.cfg.cut
    assert LLM(qwen3_dir, drafter="ngram", policy="dspark", gate="enabled=0", device="cpu").engine.runner.gate is None
    assert main(["generate", "--model", str(qwen3_dir), "--device", "cpu", "--drafter", "ngram", "--policy", "dspark",
                 "--gate", "selekt=1", "--max-tokens", "2", "hi"]) == 2
    assert "gate option 'selekt=1'" in capsys.readouterr().err
    assert main(["generate", "--model", str(qwen3_dir), "--device", "cpu", "--drafter", "ngram", "--policy", "dspark",
                 "--gate", "probe_every=2", "--max-tokens", "2", "hi"]) == 0


def row_profile(rows: bool = True) -> StepProfile:
    """A target whose forward in (gamma+1)-token rows looks nearly free to verify more tokens, while in the
    engine's own row shapes one verify row beside fifteen one-token rows costs 50% more than the plain step
    (the second attention grid) and each further draft token 0.5 ms; at one request verifying is nearly free."""
    table = dict(rows=[1, 16], row_extra=[[0, 1, GAMMA], [0, 1, 8 * GAMMA, 16 * GAMMA]],
                 row_s=[[0.0100, 0.0101, 0.0104], [0.0200, 0.0300, 0.0300 + 0.0005 * (8 * GAMMA - 1),
                                                   0.0300 + 0.0005 * (16 * GAMMA - 1)]]) if rows else {}
    return StepProfile("test", tokens=[1, 16, 80], verify_s=[0.0100, 0.0200, 0.0210], requests=[1, 16],
                       draft_s=[0.001, 0.002], **table)


def test_a_profile_in_row_shapes_prices_a_forward_by_its_rows():
    prof = row_profile()
    assert prof.raw(16, 16) == pytest.approx(0.020) and prof.raw(17, 16) == pytest.approx(0.030)
    assert prof.raw(16 + 23, 16) == pytest.approx(0.030 + 0.0005 * 22)
    assert prof.raw(1, 1) == pytest.approx(0.010) and prof.raw(1 + GAMMA, 1) == pytest.approx(0.0104)
    # between timed row counts: the two interpolated alike at the same extra tokens
    assert prof.raw(9, 8) == pytest.approx(0.0101 + (0.030 - 0.0101) * 7 / 15)
    assert prof.raw(40) == pytest.approx(0.0200 + 0.0010 * 24 / 64)  # rows unknown: the token curve
    assert row_profile(rows=False).raw(17, 16) == prof.raw(17)
    # a drafted step pays the verify row's grid whatever it verifies, as it pays its proposal
    assert prof.cost(16, 16, rows=16) == pytest.approx(0.002 + 0.030)
    assert prof.cost(0, 16, rows=16) == pytest.approx(0.020)
    prof.observe_forward(17, 0.060, rows=16)  # twice the profiled forward: the machine is twice as slow
    assert prof.verify_scale == pytest.approx(1.05)


def test_the_gate_closes_at_sixteen_requests_when_the_row_shapes_say_drafting_loses():
    for rows, opens in ((True, False), (False, True)):
        gate = Gate(GateConfig(optimism=0.0), half_accepted(), row_profile(rows))
        assert gate.should_draft(16, [GAMMA] * 16) is opens
    assert Gate(GateConfig(optimism=0.0), half_accepted(), row_profile()).should_draft(1, [GAMMA])


def test_row_shapes_time_a_plain_step_one_verify_row_half_and_all():
    from dspark.engine.profiler import row_shapes

    assert row_shapes(1, 7, 1024) == [[1], [2], [8]]
    assert row_shapes(4, 7, 1024) == [[1, 1, 1, 1], [2, 1, 1, 1], [8, 8, 1, 1], [8, 8, 8, 8]]
    assert row_shapes(64, 7, 256) == [[1] * 64, [2] + [1] * 63]  # half and all exceed the token budget


def test_profile_key_follows_the_step_code(tmp_path, monkeypatch):
    """A profile measured by other code is not reused: the key holds a digest of the code that runs a step,
    which changes when any of its files does."""
    from dspark.engine import profiler

    a, sub = tmp_path / "a.py", tmp_path / "pkg"
    sub.mkdir()
    a.write_text("x = 1\n")
    (sub / "b.py").write_text("y = 2\n")
    before = profiler.digest([a, sub])
    assert before == profiler.digest([sub, a])  # the order named does not matter
    (sub / "b.py").write_text("y = 3\n")
    assert profiler.digest([a, sub]) != before
    assert len(profiler.step_code()) == 12
    root = Path(profiler.__file__).resolve().parent.parent
    assert all((root / name).exists() for name in profiler.STEP_CODE)  # a renamed file would drop out unnoticed
    one = profiler.profile_key("m", "dspark:7", "cpu", "float32", 7, 2048, 1)
    monkeypatch.setattr(profiler, "step_code", lambda: "other")
    assert profiler.profile_key("m", "dspark:7", "cpu", "float32", 7, 2048, 1) != one


def test_a_traced_step_carries_the_gate_state_and_an_untraced_one_does_not(qwen3_dir):
    """...and `LLMEngine.gate_state`, which a server's metrics read after every step, agrees with it."""
    from dspark.config import EngineConfig
    from dspark.engine.factory import build_engine
    from dspark.sampling import SamplingParams

    engine = build_engine(qwen3_dir, "ngram", "dspark", EngineConfig(device="cpu"), profile="off")
    runner = engine.runner
    runner.set_profile(profile(0.05))  # a proposal costs five plain steps: the gate closes and probes

    states = []  # engine.gate_state() after each step that ran: what a server's metrics read

    def steps(n: int) -> list:
        engine.add_request(list(range(5, 25)), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        out = []
        while engine.has_unfinished():
            out.append(engine.step())
            if out[-1].ran:
                states.append(engine.gate_state())
        return [o for o in out if o.ran]

    assert all(o.gate is None for o in steps(6))
    runner.snapshots = True
    traced = steps(40)
    gates = [o.gate for o in traced if o.gate is not None]
    assert len(gates) == len(traced)
    assert {"open", "depth", "probe", "next_probe", "probe_extra", "acceptance", "scales"} <= set(gates[0])
    closed = [g for g in gates if not g["open"]]
    assert closed and all(g["depth"] == 0 and isinstance(g["next_probe"], int) for g in closed)
    assert len(gates[0]["acceptance"]) == runner.gamma and set(gates[0]["scales"]) == {"verify", "plain", "spec"}
    assert states[-len(gates):] == [(g["open"], g["probe"]) for g in gates]
    assert any(g["probe"] for g in gates) and build_engine(qwen3_dir, None, "none", EngineConfig(device="cpu")).gate_state() is None
    runner.gate.probing = True  # as a probe leaves it; a step that judges nothing (a prefill alone) is no probe
    engine.add_request(list(range(5, 25)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert engine.step().gate["probe"] is False and engine.gate_state()[1] is False

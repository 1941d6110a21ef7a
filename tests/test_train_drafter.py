"""Drafter training continued from a saved drafter (`init_from`): the new stage starts from those
weights and that architecture, drops the STS temperatures, and refuses a drafter of another kind."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from dspark.drafters.base import save_drafter
from dspark.drafters.registry import load_drafter, new_config, new_drafter
from dspark.models.loader import load_model
from dspark.train.drafter import DrafterTrainConfig, build, train


def write_rows(path, vocab: int, n: int = 6) -> None:
    rng = random.Random(0)
    rows = [{"prompt_ids": [rng.randrange(4, vocab) for _ in range(8)],
             "response_ids": [rng.randrange(4, vocab) for _ in range(24)]} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture()
def saved(qwen3_dir, tmp_path):
    target, _ = load_model(qwen3_dir, "cpu", "float32")
    cfg = new_config("dspark", target.config, 0, taps=(0,), sts_temperatures=(1.5,) * 7)
    torch.manual_seed(3)
    drafter = new_drafter(cfg)
    for p in drafter.parameters():  # non-zero everywhere, so "loaded" differs from "fresh"
        torch.nn.init.normal_(p, std=0.05)
    save_drafter(drafter, cfg, tmp_path / "start")
    write_rows(tmp_path / "rows.jsonl", target.config.vocab_size)
    return tmp_path


def config(qwen3_dir, root, **kw) -> DrafterTrainConfig:
    rows = str(root / "rows.jsonl")
    return DrafterTrainConfig(model=str(qwen3_dir), data=rows, heldout=rows, run_dir=str(root / "run"),
                              seq_len=32, batch_size=2, anchors_per_seq=2, max_steps=2, warmup_steps=1,
                              eval_every=1000, eval_batches=1, init_from=str(root / "start"), **kw)


def test_init_from_starts_at_the_saved_drafter(qwen3_dir, saved):
    start = load_drafter(str(saved / "start"))
    _, _, drafter, dcfg = build(config(qwen3_dir, saved))
    assert dcfg.taps == (0,) and dcfg.sts_temperatures == ()
    for name, tensor in start.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], tensor.float()), name


def test_init_from_trains_and_exports(qwen3_dir, saved):
    train(config(qwen3_dir, saved, export_dir=str(saved / "out")))
    out = load_drafter(str(saved / "out"))
    assert out.config.taps == (0,) and out.config.sts_temperatures == ()
    start = load_drafter(str(saved / "start"))
    moved = [n for n, t in out.state_dict().items() if not torch.equal(t, start.state_dict()[n])]
    assert moved  # the stage trained


def test_init_from_refuses_another_kind(qwen3_dir, saved):
    with pytest.raises(ValueError, match="not 'eagle3'"):
        build(config(qwen3_dir, saved, kind="eagle3"))


def test_init_from_grows_a_deeper_backbone_that_computes_the_same(qwen3_dir, saved):
    """num_layers above the saved drafter's: its layers first, new ones that add nothing yet."""
    start = load_drafter(str(saved / "start")).float()
    target, _, drafter, dcfg = build(config(qwen3_dir, saved, num_layers=4))
    assert dcfg.num_layers == 4 and len(drafter.backbone.layers) == 4
    torch.manual_seed(0)
    taps = torch.randn(2, 16, len(dcfg.taps) * dcfg.hidden_size)
    tokens = torch.randint(4, dcfg.vocab_size, (2, 16))
    anchors = torch.tensor([[1, 5], [0, 8]])
    start._target = [target]
    with torch.no_grad():
        a, ca = start.train_forward(taps, tokens, anchors)
        b, cb = drafter.train_forward(taps, tokens, anchors)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(ca, cb, atol=1e-5)
    train(config(qwen3_dir, saved, num_layers=4, export_dir=str(saved / "deep")))
    deep = load_drafter(str(saved / "deep"))
    assert deep.config.num_layers == 4
    assert deep.state_dict()["backbone.layers.3.mlp.down_proj.weight"].abs().sum() > 0  # the new layers trained
    with pytest.raises(ValueError, match="deeper"):
        build(config(qwen3_dir, saved, num_layers=1))


def test_init_from_moves_to_other_target_layers(qwen3_dir, saved):
    """taps in the config move a saved drafter onto other layers (a target grown deeper), same count only."""
    _, _, drafter, dcfg = build(config(qwen3_dir, saved, taps=(2,)))
    assert dcfg.taps == (2,) and drafter.taps == (2,)
    with pytest.raises(ValueError, match="taps"):
        build(config(qwen3_dir, saved, taps=(0, 1)))


def test_init_from_changes_the_sequential_head_and_keeps_the_rank_unless_told(qwen3_dir, saved):
    """head / rank in the config rehead a saved DSpark drafter (train/surgery.py); a config that names
    neither keeps the saved head and rank, whatever that rank is; a narrower rank is refused."""
    _, _, same, dcfg = build(config(qwen3_dir, saved))
    assert (dcfg.head, dcfg.rank) == ("markov", 64)
    train(config(qwen3_dir, saved, head="rnn", rank=96, export_dir=str(saved / "rnn")))
    out = load_drafter(str(saved / "rnn"))
    assert (out.config.head, out.config.rank) == ("rnn", 96)
    save_drafter(out, out.config, saved / "start")  # the rnn drafter, rank 96, as the next stage's start
    _, _, again, dcfg = build(config(qwen3_dir, saved))
    assert (dcfg.head, dcfg.rank) == ("rnn", 96)
    with pytest.raises(ValueError, match="rehead"):
        build(config(qwen3_dir, saved, head="markov"))


def test_grown_lr_moves_the_weights_a_surgery_added_at_their_own_rate(qwen3_dir, saved):
    """With grown_lr, the weights an mlp head adds (and only they) train at that peak rate: at lr 1e-9 for the rest,
    the saved weights end within rounding of where they started and the grown ones move; without it, nothing
    grown moves beyond what the tiny lr allows. The optimizer's groups carry the scale a resumed run reads back."""
    from dspark.train.drafter import optimizer, trainable

    start = load_drafter(str(saved / "start")).state_dict()
    moves = {}
    for grown_lr in (0.0, 1e-2):
        out_dir = saved / f"out{grown_lr}"
        cfg = dataclasses.replace(config(qwen3_dir, saved, head="mlp", lr=1e-9, grown_lr=grown_lr,
                                         export_dir=str(out_dir)), run_dir=str(saved / f"run{grown_lr}"))
        _, _, drafter, _ = build(cfg)
        assert drafter.grown == {"head.mix_in.weight", "head.mix_in.bias", "head.mix_out.weight"}
        scales = [g["scale"] for g in optimizer(trainable(drafter, cfg), cfg, drafter).param_groups]
        assert scales == ([1.0, 1e7] if grown_lr else [1.0])
        train(cfg)
        out = load_drafter(str(out_dir)).state_dict()
        for name in start:
            assert torch.allclose(out[name].float(), start[name].float(), atol=1e-6), name
        moves[grown_lr] = (out["head.mix_out.weight"].float().abs().max().item())
    assert moves[0.0] < 1e-6 < 1e-4 < moves[1e-2]  # mix_out starts at zero


def test_eval_drafter_measures_a_saved_drafter_as_training_does(qwen3_dir, saved):
    from dspark.train.drafter import evaluate, read_rows
    from dspark.train.eval_drafter import evaluate_drafters

    cfg = dataclasses.replace(config(qwen3_dir, saved), eval_batches=2)
    target, tok, drafter, _ = build(cfg)
    expected = evaluate(drafter, target, read_rows(cfg.heldout), cfg, 7, tok.token_id("<|endoftext|>") or 0)
    result = evaluate_drafters(cfg, [str(saved / "start")])
    measured = result["drafters"][str(saved / "start")]
    assert {k: v for k, v in measured.items() if not k.startswith("walk_")} == expected
    assert measured["walk_tau"] >= 1.0 and measured["walk_rounds"] > 0
    assert evaluate_drafters(cfg, [str(saved / "start")], anchors=3)["settings"]["anchors_per_seq"] == 3
    with pytest.raises(ValueError, match="at least one drafter"):
        evaluate_drafters(cfg, [])


def test_greedy_acceptance_counts_a_block_until_its_first_wrong_argmax():
    from dspark.train.drafter import argmax_chain, expected_tau

    t = torch.eye(4)[torch.tensor([[0, 1, 2], [0, 1, 2], [3, 3, 3]])]  # [3 blocks, 3 positions, vocab 4]: target argmaxes
    d = torch.eye(4)[torch.tensor([[0, 1, 3], [0, 2, 2], [3, 3, 3]])]  # block 0 fails at 3, block 1 at 2 (then matches again)
    valid = torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 1, 0]])  # block 2's last position is past the text
    hits, tried = argmax_chain(d, t, valid)
    assert hits.tolist() == [3, 2, 0] and tried.tolist() == [3, 3, 1]
    assert expected_tau([1.0, 2 / 3, 0.0]) == pytest.approx(1 + 1 + 2 / 3, abs=1e-4)


def test_eval_drafter_command_measures_on_other_heldout_answers(qwen3_dir, saved):
    from dspark.cli import main

    cfg = config(qwen3_dir, saved)
    toml = saved / "eval.toml"
    toml.write_text("".join(f"{k} = {json.dumps(getattr(cfg, k))}\n" for k in
                            ("kind", "model", "data", "heldout", "seq_len", "batch_size", "anchors_per_seq", "eval_batches")))
    write_rows(saved / "other.jsonl", 64, n=3)
    out = saved / "eval.json"
    assert main(["train", "eval-drafter", "--config", str(toml), "--drafter", str(saved / "start"),
                 "--heldout", str(saved / "other.jsonl"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["heldout"] == str(saved / "other.jsonl")
    measured = result["drafters"][str(saved / "start")]
    assert len(measured["greedy_acceptance"]) == 7 and measured["greedy_tau"] >= 1.0


def test_walk_counts_the_rounds_a_greedy_run_takes_on_its_own_answers():
    """On the target's greedy answers, the walk (teacher-forced blocks at every position, verification
    replayed along the text) takes the rounds a greedy `static:7` run of the shipped DSpark drafter took,
    one by one: training's forward and serving's proposal agree, and `walk_tau` is the τ users see."""
    from dspark import LLM, SamplingParams
    from dspark.models.loader import ASSETS
    from dspark.train.drafter import load_frozen_target
    from dspark.train.eval_drafter import walk

    llm = LLM(drafter="dspark", policy="static:7", draft_vocab=0, dtype="float32")
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What is 12 times 7?", "Write a Python function that adds two numbers.")]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=48))
    rows = [{"prompt_ids": i, "response_ids": o.token_ids} for i, o in zip(ids, outs, strict=True)]
    cfg = DrafterTrainConfig(model="dspark-small", seq_len=256)
    target, tok = load_frozen_target(cfg)
    drafter = load_drafter(str(ASSETS / "dspark-small" / "drafters" / "dspark")).float()
    drafter._target = [target]
    got = walk(drafter, target, rows, cfg, tok.pad_id)
    served_rounds = sum(o.stats["rounds"] - 1 for o in outs)  # the prefill round drafts nothing
    served_tokens = sum(len(o.token_ids) - 1 for o in outs)
    assert got["walk_rounds"] == served_rounds and got["walk_tau"] == round(served_tokens / served_rounds, 4)
    assert got["walk_tau"] > 1.0  # the drafter was accepted somewhere: the comparison is not vacuous


def test_walk_rows_are_spread_through_the_file():
    from dspark.train.eval_drafter import spread

    rows = [{"i": i} for i in range(10)]
    assert [r["i"] for r in spread(rows, 4)] == [0, 2, 5, 7] and spread(rows, 20) == rows


def test_rounds_along_an_answer_move_past_the_token_after_the_accepted_drafts():
    from dspark.train.eval_drafter import rounds_along

    chain = {10: 2, 13: 0, 14: 5, 20: 7}  # accepted drafts per anchor position
    assert rounds_along(chain, 10, 24, 7) == [(2, 7), (0, 7), (5, 7), (3, 3)]  # the last round: room for 3 before 24
    assert rounds_along({}, 5, 5, 7) == [] and rounds_along({5: 4}, 5, 6, 7) == [(0, 1)]


def test_round_starts_follow_the_rounds_along_an_answer():
    from dspark.train.eval_drafter import rounds_along, starts_of

    chain = {10: 2, 13: 0, 14: 5, 20: 7}
    assert starts_of(rounds_along(chain, 10, 24, 7), 10) == [10, 13, 14, 20] and starts_of([], 5) == []


def test_walked_anchors_come_from_the_round_starts_and_the_rest_uniformly():
    import numpy as np

    from dspark.train.anchors import make_batch, pick_anchors

    row = {"prompt_ids": [1] * 8, "response_ids": list(range(4, 60)), "walk": [8, 11, 12, 20, 30, 2, 70]}
    inside = {8, 11, 12, 20, 30}  # 2 is in the prompt, 70 past the window [8, 40)
    all_walked = pick_anchors(row, 8, 40, 4, 1.0, np.random.default_rng(0))
    assert set(all_walked) <= inside and len(set(all_walked)) == 4
    more = pick_anchors(row, 8, 40, 10, 1.0, np.random.default_rng(0))  # only 5 starts: all taken, 5 uniform
    assert inside <= set(more) and len(set(more)) == 10 and list(more) == sorted(more)
    half = pick_anchors(row, 8, 40, 8, 0.5, np.random.default_rng(1))
    assert len(inside & set(half)) >= 4 and len(set(half)) == 8
    plain = {k: v for k, v in row.items() if k != "walk"}  # walked = 0, or no walk: the uniform draw as before
    a = make_batch([row], 41, 3, 6, np.random.default_rng(2))
    b = make_batch([plain], 41, 3, 6, np.random.default_rng(2), walked=0.5)
    assert torch.equal(a.anchors, b.anchors)
    c = make_batch([row], 41, 3, 4, np.random.default_rng(2), walked=1.0)
    assert set(c.anchors[0].tolist()) <= inside


def test_walk_command_writes_each_answers_round_starts(qwen3_dir, saved):
    """`dspark train walk` writes every answer back with the positions its walked rounds start from: the
    first at the answer's start, each next one past the drafts the round before accepted, as `eval-drafter`'s
    walk counts them."""
    from dspark.cli import main
    from dspark.train.eval_drafter import walk

    cfg = config(qwen3_dir, saved)
    toml = saved / "walk.toml"
    toml.write_text("".join(f"{k} = {json.dumps(getattr(cfg, k))}\n" for k in ("kind", "model", "seq_len")))
    out = saved / "walked.jsonl"
    assert main(["train", "walk", "--config", str(toml), "--drafter", str(saved / "start"),
                 "--data", str(saved / "rows.jsonl"), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and all(r["walk"][0] == len(r["prompt_ids"]) for r in rows)
    assert all(r["walk"] == sorted(set(r["walk"])) and r["walk"][-1] < 31 for r in rows)
    target, tok = load_model(qwen3_dir, "cpu", "float32")
    drafter = load_drafter(str(saved / "start")).float()
    drafter._target = [target]
    assert sum(len(r["walk"]) for r in rows) == walk(drafter, target, rows, cfg, tok.pad_id)["walk_rounds"]


def test_fed_blocks_train_and_are_measured_refined(qwen3_dir, saved):
    """`fed` draws that share of blocks to read the text's tokens (deterministic per step); training runs on
    them, and the held-out evaluation of a causal block also reports what a refining pass would accept."""
    from dspark.train.drafter import batch_at, evaluate, read_rows

    cfg = dataclasses.replace(config(qwen3_dir, saved, causal_block=True, fed=0.5, export_dir=str(saved / "fed")),
                              anchors_per_seq=8)
    target, tok, drafter, dcfg = build(cfg)
    rows = read_rows(cfg.data)
    batch = batch_at(rows, cfg, 7, 0, 0, 0)
    assert batch.fed is not None and batch.fed.shape == batch.anchors.shape
    assert 0 < int(batch.fed.sum()) < batch.fed.numel() and torch.equal(batch.fed, batch_at(rows, cfg, 7, 0, 0, 0).fed)
    assert batch_at(rows, dataclasses.replace(cfg, fed=0.0), 7, 0, 0, 0).fed is None
    report = evaluate(drafter, target, read_rows(cfg.heldout), cfg, 7, 0)
    assert len(report["refined_acceptance"]) == 7 and report["refined_tau"] >= 1.0
    train(cfg)
    assert load_drafter(str(saved / "fed")).config.causal_block
    from dspark.train.eval_drafter import chain_of, evaluate_drafters

    measured = evaluate_drafters(cfg, [str(saved / "fed")])["drafters"][str(saved / "fed")]
    assert {"walk_tau", "refined_walk_tau", "fed_walk_tau"} <= set(measured)
    trained = load_drafter(str(saved / "fed")).float()
    trained._target = [target]  # type: ignore[attr-defined]
    anchors = 0
    for row in rows:  # a refined draft is kept through the fed block's first miss and one past the first pass's
        chains = chain_of(trained, target, row, cfg, 0)
        anchors += len(chains["refined_walk"])
        for p, n in chains["refined_walk"].items():
            assert n <= chains["fed_walk"][p] and n <= chains["walk"][p] + 1
    assert anchors > 0

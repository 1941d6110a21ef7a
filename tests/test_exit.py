"""The DSpark early exit (`DrafterConfig.exit_mlp`): a one-position proposal from the exit's own layer equals its
teacher-forced form, deeper proposals never read it, a grown exit starts as a copy of the backbone layer it replaces,
and an `exit_only` run moves the exit's weights and nothing else."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark.drafters.base import ContextRow, ProposeInput, save_drafter
from dspark.drafters.registry import load_drafter, new_config, new_drafter
from dspark.models.loader import load_model
from dspark.sampling import SamplingParams, SamplingRows
from dspark.train.drafter import DrafterTrainConfig, train
from dspark.train.eval_drafter import evaluate_drafters
from dspark.train.surgery import with_exit
from tests.test_train_drafter import write_rows

CONTEXT = list(range(3, 20))
GREEDY = SamplingRows.same(1, SamplingParams(temperature=0.0))


@pytest.fixture(scope="module")
def target(qwen3_dir):
    net, _ = load_model(qwen3_dir)
    return net


def drafter(target, exit_mlp: int = 16, **over):
    """A random causal-block DSpark drafter (with an exit whose confidence head is non-zero, on the block's input
    unless told), bound and fed the context."""
    torch.manual_seed(1)
    d = new_drafter(new_config("dspark", target.config, 5, causal_block=True, exit_mlp=exit_mlp, **over))
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "w2" in name or "conf" in name:
                p.normal_(0, 0.3)
    return bind(d, target)


def bind(d, target):
    d.bind(target, 64, 4)
    with torch.no_grad():
        _, taps = target.forward_dense(torch.tensor([CONTEXT]), d.taps)
    d.extend([ContextRow("r", 0, CONTEXT[:-1], taps[0, :-1])])
    return d


def propose(d, depth: int | None = None, rows: SamplingRows = GREEDY):
    return d.propose([ProposeInput("r", CONTEXT[-1], len(CONTEXT) - 1, CONTEXT)], rows, depth)


def exit_teacher_forced(d, target):
    tokens = torch.tensor([CONTEXT])
    with torch.no_grad():
        _, taps = target.forward_dense(tokens, d.taps)
        return d.exit_forward(taps, tokens, torch.tensor([[len(CONTEXT) - 1]]))


@pytest.mark.parametrize("exit_layer", [0, 1])
def test_a_one_position_proposal_is_the_exit_and_equals_its_teacher_forced_form(target, exit_layer):
    d = drafter(target, exit_layer=exit_layer)
    logits, conf = exit_teacher_forced(d, target)
    one = propose(d, 1)
    assert one.num_valid == [1] and one.tokens[0, 0].item() == logits[0, 0, 0].argmax().item()
    assert torch.allclose(one.confidence[0, 0], torch.sigmoid(conf[0, 0, 0]), atol=1e-5)
    assert d.pool.length("r") == len(CONTEXT) - 1  # the temporary slot was rolled back
    sampled = propose(d, 1, SamplingRows.same(1, SamplingParams(temperature=1.0, seed=0)))
    assert torch.allclose(sampled.probs[0, 0], logits[0, 0, 0].softmax(-1), atol=1e-5)  # the draft distribution
    full, _ = d.train_forward(*teacher_inputs(d, target, propose(d).tokens[0].tolist()))
    assert not torch.allclose(full[0, 0, 0], logits[0, 0, 0], atol=1e-3)  # the exit is not the block's first slot


def teacher_inputs(d, target, drafted: list[int]):
    tokens = torch.tensor([CONTEXT + drafted])
    with torch.no_grad():
        _, taps = target.forward_dense(tokens, d.taps)
    return taps, tokens, torch.tensor([[len(CONTEXT) - 1]])


def test_deeper_proposals_never_read_the_exit(target):
    """With an exit, proposals of two or more positions are exactly those of the same drafter without one."""
    plain, exited = drafter(target, 0), drafter(target)
    exited.load_state_dict(plain.state_dict(), strict=False)
    for depth in (None, 2):
        a, b = propose(plain, depth), propose(exited, depth)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.confidence, b.confidence)


def test_a_grown_exit_starts_as_the_backbone_layer_it_copies(target):
    """with_exit copies backbone layer 0, the final norm and the confidence head: the exit's logits are then the LM
    head (and sequential head) on the final norm of the first layer's output; the full block is unchanged."""
    plain = drafter(target, 0)
    width = plain.config.intermediate_size
    grown = bind(with_exit(plain, 0, width), target)
    assert (grown.config.exit_layer, grown.config.exit_mlp, grown.cache_layers) == (0, width, 3)
    assert torch.equal(propose(plain).tokens, propose(grown).tokens)
    logits, conf = exit_teacher_forced(grown, target)
    taps, tokens, anchors = teacher_inputs(grown, target, [])
    with torch.no_grad():
        x = grown.backbone.block_start(grown.embed(tokens[:, -1:])[:, None], None).flatten(1, 2)
        from dspark.drafters.block import block_mask

        h = grown.backbone.run_dense(x, anchors, grown.backbone.context(taps), block_mask(anchors, 1, taps.shape[1], True),
                                     1, 1)
        want, want_conf = grown.scored(grown.backbone.norm(h).view(1, 1, 1, -1), tokens[:, -1:][:, None], grown.conf,
                                       False)
    assert torch.allclose(logits, want, atol=1e-5) and torch.allclose(conf, want_conf, atol=1e-5)
    with pytest.raises(ValueError, match="without one an exit"):
        with_exit(grown, 0, 24)


@pytest.mark.parametrize(("over", "match"), [({"causal_block": False}, "causal"), ({"exit_layer": 2}, "fewer"),
                                             ({"exit_mlp": 0}, "exit_mlp >= 1")])
def test_an_exit_needs_a_causal_block_an_earlier_layer_and_an_mlp(target, over, match):
    cfg = {"causal_block": True, "exit_layer": 1, "exit_mlp": 8, **over}
    with pytest.raises(ValueError, match=match):
        new_config("dspark", target.config, 5, **cfg)
    with pytest.raises(ValueError, match="early exit"):
        new_config("eagle3", target.config, 5, exit_mlp=8)


def test_exit_only_training_moves_the_exit_alone(qwen3_dir, tmp_path):
    net, _ = load_model(qwen3_dir, "cpu", "float32")
    cfg = new_config("dspark", net.config, 0, taps=(0,), causal_block=True)
    torch.manual_seed(3)
    start = new_drafter(cfg)
    save_drafter(start, cfg, tmp_path / "start")
    write_rows(tmp_path / "rows.jsonl", net.config.vocab_size)
    rows = str(tmp_path / "rows.jsonl")
    run = DrafterTrainConfig(model=str(qwen3_dir), data=rows, heldout=rows, run_dir=str(tmp_path / "run"),
                             seq_len=32, batch_size=2, anchors_per_seq=2, max_steps=2, warmup_steps=1, eval_every=2,
                             eval_batches=1, init_from=str(tmp_path / "start"), exit_mlp=24, exit_only=True,
                             export_dir=str(tmp_path / "out"))
    report = train(run)
    assert len(report["acceptance"]) == 1 and len(report["conf_mae"]) == 1  # the exit's one position
    out, grown = load_drafter(str(tmp_path / "out")), with_exit(start, 0, 24).state_dict()
    assert out.config.exit_mlp == 24 and out.state_dict().keys() == grown.keys()
    moved = {n for n, t in out.state_dict().items() if not torch.equal(t, grown[n])}
    assert "exit.layer.mlp.down_proj.weight" in moved and all(n.startswith("exit.") for n in moved)
    measured = evaluate_drafters(dataclasses.replace(run, exit_only=False), [run.export_dir])["drafters"]
    got = measured[run.export_dir]  # the block's seven positions, and the exit's one as training measured it
    assert len(got["acceptance"]) == 7 and got["exit_acceptance"] == report["acceptance"]
    with pytest.raises(ValueError, match="exit_mlp and init_from"):
        DrafterTrainConfig(exit_only=True)

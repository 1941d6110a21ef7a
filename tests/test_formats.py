"""Published drafter formats (dspark/drafters/formats/): each committed random-weight fixture
(tests/fixtures/checkpoints/, made by scripts/fixtures/make_*.py with the reference code)
loads by detection, reproduces the reference's block logits and confidences in float32, and
serves in the engine with greedy output identical to plain decoding."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dspark.config import EngineConfig
from dspark.drafters.base import ContextRow, ProposeInput
from dspark.drafters.formats import detect
from dspark.drafters.registry import load_drafter
from dspark.engine.factory import assemble
from dspark.models.loader import load_model, load_target
from dspark.sampling import SamplingParams, SamplingRows

ROOT = Path(__file__).parent / "fixtures" / "checkpoints"
FIXTURES = {"deepspec": "deepspec", "deepspec_gated": "deepspec", "deepspec_rnn": "deepspec", "dflash": "dflash",
            "speculators_dspark": "speculators", "speculators_eagle3": "speculators", "eagle": "eagle"}


def fixture(name: str):
    meta = json.loads((ROOT / name / "reference.json").read_text())
    return meta, load_file(str(ROOT / name / "reference.safetensors"))


def loaded(name: str):
    meta, _ = fixture(name)
    target = load_target(ROOT / meta["target"])
    drafter = load_drafter(str(ROOT / name), target=target.config)
    drafter.bind(target, num_blocks=32, block_size=4)
    return target, drafter


def propose_logits(target, drafter, context: list[int], anchor: int):
    """The serving path (context features into the drafter's paged cache, one greedy block),
    recording the logits each draft token is drawn from."""
    _, taps = target.forward_dense(torch.tensor([context]), taps=drafter.taps)
    drafter.extend([ContextRow("r", 0, context, taps[0])])
    seen, pick = [], drafter.pick

    def record(logits, rows, generators):
        seen.append(logits[0].clone())
        return pick(logits, rows, generators)

    drafter.pick = record
    block = drafter.propose([ProposeInput("r", anchor, len(context), context)],
                            SamplingRows.same(1, SamplingParams(temperature=0.0)))
    return block, torch.stack(seen)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_matches_reference(name):
    meta, ref = fixture(name)
    assert detect(ROOT / name) == FIXTURES[name]
    target, drafter = loaded(name)
    block, logits = propose_logits(target, drafter, meta["context"], meta["anchor"])
    n = len(meta["tokens"])  # EAGLE-3's own config does not say how many steps: dspark drafts 7, the reference 5
    assert logits.shape[0] == n or FIXTURES[name] == "eagle"
    assert logits[:n].shape == ref["logits"].shape
    assert (logits[:n] - ref["logits"]).abs().max().item() < 1e-4
    assert block.tokens[0, :n].tolist() == meta["tokens"]
    if "confidence_logits" in ref:
        assert (block.confidence_logits[0] - ref["confidence_logits"]).abs().max().item() < 1e-4
        assert torch.allclose(block.confidence[0], torch.sigmoid(ref["confidence_logits"]))  # raw: no STS file


def greedy_outputs(target_dir, drafter_dir=None, policy="none"):
    net, tok = load_model(target_dir)
    drafter = load_drafter(str(drafter_dir), target=net.config) if drafter_dir else None
    engine = assemble(net, tok, EngineConfig(device="cpu", block_size=4, max_num_batched_tokens=64), drafter=drafter,
                       policy=policy)
    prompts = [[3 + (7 * i + j) % 200 for j in range(5 + 3 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = engine.run_until_done([engine.add_request(p, params) for p in prompts])
    return [o.token_ids for o in outs], engine, sum(o.stats["verified_tokens"] for o in outs)


@functools.cache
def plain_outputs(target: str) -> list[list[int]]:
    return greedy_outputs(ROOT / target)[0]


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_serves_lossless(name):
    target_dir = ROOT / fixture(name)[0]["target"]
    plain = plain_outputs(target_dir.name)
    for policy in ("static:3", "dspark"):
        spec, engine, verified = greedy_outputs(target_dir, ROOT / name, policy)
        assert spec == plain, (name, policy)
        assert verified > 0  # draft tokens were verified: the drafter really ran
        assert engine.drafter.cache_bytes_in_use() == 0


def test_fewer_draft_tokens_still_run_the_whole_block():
    """--gamma below the checkpoint's block keeps the block's slots (bidirectional attention within
    the block: a shorter block would change every position), so the first logits still match."""
    meta, ref = fixture("deepspec")
    target, drafter = loaded("deepspec")
    drafter.config = drafter.config.replace(gamma=2)
    block, logits = propose_logits(target, drafter, meta["context"], meta["anchor"])
    assert block.tokens.shape == (1, 2)
    assert (logits - ref["logits"][:2]).abs().max().item() < 1e-4


def test_llm_serves_a_published_drafter_directory():
    from dspark.llm import LLM

    llm = LLM(str(ROOT / "target_qwen3"), drafter=str(ROOT / "deepspec"), policy="dspark", profile="off", device="cpu")
    assert llm.engine.drafter.has_confidence
    out = llm.generate([[5, 9, 14, 3]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert out[0].token_ids == plain_outputs_for([5, 9, 14, 3], 8)


def plain_outputs_for(prompt: list[int], n: int) -> list[int]:
    net, tok = load_model(ROOT / "target_qwen3")
    engine = assemble(net, tok, EngineConfig(device="cpu", block_size=4))
    return engine.run_until_done([engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                                           ignore_eos=True))])[0].token_ids


def test_calibrate_works_on_a_published_checkpoint(tmp_path):
    """A DeepSpec checkpoint has no STS temperatures: it serves raw confidences (above) until
    `dspark calibrate` writes `sts_temperatures` into its config.json, which then loads back."""
    import shutil

    from dspark.train.calibrate import calibrate

    drafter_dir = tmp_path / "deepspec"
    shutil.copytree(ROOT / "deepspec", drafter_dir)
    cal = calibrate(str(ROOT / "target_qwen3"), str(drafter_dir), ["t5 t9 t14 t3 t77", "t20 t21 t22 t40"],
                    str(tmp_path / "out"), max_tokens=12, temperature=1.0)
    raw = json.loads((drafter_dir / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and len(raw["sts_temperatures"]) == len(cal.temperatures) == 5
    drafter = load_drafter(str(drafter_dir), target=load_target(ROOT / "target_qwen3").config)
    assert drafter.config.sts_temperatures == tuple(raw["sts_temperatures"])


def test_tap_minus_one_is_the_embedding_output():
    target = load_target(ROOT / "target_qwen3")
    ids = torch.tensor([[5, 9, 14]])
    _, taps = target.forward_dense(ids, taps=(-1, 1))
    _, layer1 = target.forward_dense(ids, taps=(1,))
    d = target.config.hidden_size
    assert torch.equal(taps[..., :d], target.model.embed_tokens(ids)) and torch.equal(taps[..., d:], layer1)


def test_speculators_dflash_matches_the_zlab_reference(tmp_path):
    """The z-lab DFlash fixture rewritten as speculators' converter writes it (`speculators_model_type:
    dflash`, aux ids = z-lab ids + 1, slot 0 not sampled) gives the same block logits."""
    import shutil

    zlab = json.loads((ROOT / "dflash" / "config.json").read_text())
    layer = {k: v for k, v in zlab.items() if k not in ("architectures", "block_size", "dflash_config", "num_target_layers")}
    raw = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"], "transformer_layer_config": layer,
           "draft_vocab_size": zlab["vocab_size"], "block_size": zlab["block_size"], "sample_from_anchor": False,
           "aux_hidden_state_layer_ids": [i + 1 for i in zlab["dflash_config"]["target_layer_ids"]],
           "mask_token_id": zlab["dflash_config"]["mask_token_id"],
           "speculators_config": {"proposal_methods": [{"speculative_tokens": zlab["block_size"] - 1}]}}
    out = tmp_path / "speculators_dflash"
    out.mkdir()
    shutil.copy(ROOT / "dflash" / "model.safetensors", out)
    (out / "config.json").write_text(json.dumps(raw))
    meta, ref = fixture("dflash")
    target = load_target(ROOT / "target_qwen3")
    drafter = load_drafter(str(out), target=target.config)
    drafter.bind(target, num_blocks=32, block_size=4)
    block, logits = propose_logits(target, drafter, meta["context"], meta["anchor"])
    assert detect(out) == "speculators" and drafter.config.kind == "dflash"
    assert (logits - ref["logits"]).abs().max().item() < 1e-4


def test_draft_vocab_does_not_apply_to_a_checkpoints_own_vocabulary():
    _, drafter = loaded("speculators_eagle3")
    with pytest.raises(ValueError, match="draft-vocab"):
        drafter.restrict_vocab([1, 2, 3])
    drafter.restrict_vocab(None)  # back to the checkpoint's own draft vocabulary, not the whole one
    assert drafter.vocab_ids.tolist() == list(drafter.config.draft_vocab)

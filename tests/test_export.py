"""`dspark export-drafter`: a dspark DSpark drafter written as a DeepSpec or a speculators
checkpoint loads back through format detection with the same block logits, confidences and
STS temperatures (scripts/fixtures/check_export.py compares it against the reference code)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_formats import ROOT, propose_logits

from dspark.drafters.base import save_drafter
from dspark.drafters.formats import detect
from dspark.drafters.formats.export import export
from dspark.drafters.registry import load_drafter, new_config, new_drafter
from dspark.models.loader import load_target

TARGET = ROOT / "target_qwen3"


def trained_like(tmp_path: Path, head: str) -> Path:
    """A dspark DSpark drafter with random weights everywhere (the sequential head's W2 starts at 0
    in training) and STS temperatures for sampled and greedy requests, saved in dspark's own format."""
    target = load_target(TARGET)
    cfg = new_config("dspark", target.config, mask_token_id=255, head=head, rank=8, gamma=5,
                     sts_temperatures=(0.9, 1.1, 0.8, 1.2, 1.0), sts_greedy=(1.3, 0.7, 1.6, 0.6, 2.0))
    torch.manual_seed(3)
    drafter = new_drafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.1) if p.dim() >= 2 else p.uniform_(0.9, 1.1)
    save_drafter(drafter, cfg, tmp_path / "ours")
    return tmp_path / "ours"


def outputs(path: Path, target_dir: Path = TARGET):
    target = load_target(target_dir)
    drafter = load_drafter(str(path), target=target.config)
    drafter.bind(target, num_blocks=32, block_size=4)
    block, logits = propose_logits(target, drafter, [5, 9, 14, 3, 77, 120, 42], 8)
    return drafter, block, logits


@pytest.mark.parametrize("fmt", ["deepspec", "speculators"])
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_export_round_trips_through_the_loader(tmp_path, fmt, head):
    ours = trained_like(tmp_path, head)
    out = export(str(ours), str(TARGET), fmt, str(tmp_path / fmt))
    assert detect(out) == fmt
    d0, b0, l0 = outputs(ours)
    d1, b1, l1 = outputs(out)
    assert d1.config.sts_temperatures == d0.config.sts_temperatures and d1.config.sts_greedy == d0.config.sts_greedy
    assert d1.config.taps == d0.config.taps and d1.config.gamma == d0.config.gamma
    assert (l1 - l0).abs().max().item() < 1e-5
    assert torch.equal(b1.tokens, b0.tokens)
    assert (b1.confidence - b0.confidence).abs().max().item() < 1e-6


def test_export_refuses_what_the_formats_cannot_hold(tmp_path):
    ours = trained_like(tmp_path, "markov")
    from dspark.drafters.base import DrafterConfig

    raw = DrafterConfig.from_json((ours / "config.json").read_text())
    (ours / "config.json").write_text(dataclasses.replace(raw, head="none", confidence=False).to_json())
    (ours / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="markov_rank"):
        export(str(ours), str(TARGET), "deepspec", str(tmp_path / "x"))


def test_export_refuses_a_causal_block_and_an_mlp_head(tmp_path):
    from dspark.drafters.formats.deepspec import check_exportable
    from dspark.drafters.registry import load_drafter

    cfg = load_drafter(str(trained_like(tmp_path, "markov"))).config
    check_exportable(cfg)
    with pytest.raises(ValueError, match="causal"):
        check_exportable(cfg.replace(causal_block=True))
    with pytest.raises(ValueError, match="'mlp' sequential head"):
        check_exportable(cfg.replace(head="mlp"))


def test_export_refuses_two_drafters_joined(tmp_path):
    """A pair (`DEEP+ONE`) or a routed name (`NAME+suffix`) is two drafters; a checkpoint holds one."""
    target = load_target(TARGET)
    mtp = new_config("mtp", target.config, mask_token_id=255)
    save_drafter(new_drafter(mtp), mtp, tmp_path / "mtp")
    causal = new_config("dspark", target.config, mask_token_id=255, causal_block=True, rank=8)
    save_drafter(new_drafter(causal), causal, tmp_path / "causal")
    for name in (f"{tmp_path / 'causal'}+{tmp_path / 'mtp'}", f"{tmp_path / 'causal'}+suffix"):
        with pytest.raises(ValueError, match="joins two drafters"):
            export(name, str(TARGET), "speculators", str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_eagle3_in_the_published_layout_exports_to_speculators(tmp_path):
    """An original EAGLE-3 checkpoint converted to speculators' eagle3 (what vLLM serves)."""
    target = ROOT / "target_llama"
    out = export(str(ROOT / "eagle"), str(target), "speculators", str(tmp_path / "eagle3"))
    assert detect(out) == "speculators"
    d0, b0, l0 = outputs(ROOT / "eagle", target)
    d1, b1, l1 = outputs(out, target)
    assert d1.config.split_entry and d1.config.draft_vocab == d0.config.draft_vocab and d1.config.taps == d0.config.taps
    assert (l1 - l0).abs().max().item() < 1e-6 and torch.equal(b1.tokens, b0.tokens)

"""The shipped targets (dspark-tiny, dspark-small) load with our loader and with transformers'
Auto classes, and both give the same logits and the same chat rendering on a few prompts."""

from __future__ import annotations

import pytest
import torch

from dspark.models.loader import BUILTIN_MODELS, DEFAULT_MODEL, load_model

PROMPTS = ["Natalia sold clips to 48 of her friends in April.", "Complete the following Python function:",
           "Explain the with statement."]


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_shipped_target_matches_transformers(name):
    import transformers

    net, tok = load_model(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(BUILTIN_MODELS[name], dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(BUILTIN_MODELS[name])
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ours_text = tok.apply_chat_template(messages)
        assert ours_text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(ours_text)
        assert ids == hf_tok(ours_text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            hidden, _ = net.forward_dense(torch.tensor([ids]))
            ours = net.logits(hidden, normed=True)[0]
            theirs = hf(torch.tensor([ids])).logits[0]
        assert (ours - theirs).abs().max().item() < 1e-3


def test_dspark_small_is_deep_and_thin():
    """dspark-small: dspark-tiny's tokenizer and width, four times its depth (verifying a block costs
    about one step on a CPU when per-layer work dominates)."""
    small, small_tok = load_model("dspark-small")
    tiny, tiny_tok = load_model("dspark-tiny")
    cfg = small.config
    assert cfg.model_type == "qwen3" and cfg.num_hidden_layers >= 24 and cfg.hidden_size == tiny.config.hidden_size
    assert small_tok.encode("def f(x):\n    return x") == tiny_tok.encode("def f(x):\n    return x")
    assert 15e6 <= sum(p.numel() for p in small.parameters()) <= 30e6


def test_shipped_target_is_the_default_and_in_spec():
    net, tok = load_model(None)
    cfg = net.config
    assert DEFAULT_MODEL == "dspark-small" and net.config == load_model(DEFAULT_MODEL)[0].config
    assert cfg.model_type == "qwen3" and cfg.num_hidden_layers >= 24 and cfg.max_position_embeddings >= 1024
    assert 15e6 <= sum(p.numel() for p in net.parameters()) <= 30e6
    assert cfg.vocab_size == 8192 and tok.token_id("<|mask|>") is not None
    assert tok.token_id("<|im_end|>") in tok.eos_token_ids


def test_a_policy_without_a_drafter_uses_the_shipped_drafter(qwen3_dir):
    import pytest

    from dspark.engine.factory import build_engine

    engine = build_engine(None, policy="static:3", profile="off")
    assert engine.drafter is not None and engine.drafter.config.kind == "dspark"
    assert build_engine(None, policy="none").drafter is None
    with pytest.raises(ValueError, match="needs a drafter"):  # a model with no shipped drafter
        build_engine(str(qwen3_dir), policy="static:3", profile="off")


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_every_builtin_model_ships_its_drafters(name):
    """Each built-in target carries dspark, dflash, eagle3 and mtp drafters trained for it, and
    naming neither drafter nor policy gives the dspark drafter under the dspark policy."""
    from dspark.drafters.registry import load_drafter
    from dspark.engine.factory import default_spec

    net, tok = load_model(name)
    assert default_spec(name) == ("dspark", "dspark")
    for kind in ("dspark", "dflash", "eagle3", "mtp"):
        d = load_drafter(kind, BUILTIN_MODELS[name], net.config, tok.token_id("<|mask|>"))
        assert d.config.kind == kind and max(d.config.taps) < net.config.num_hidden_layers


def test_a_builtin_model_missing_from_the_install_says_so(monkeypatch, tmp_path):
    """A wheel carries the default model only; naming another built-in there says where it comes from."""
    from dspark.models import loader

    monkeypatch.setitem(loader.BUILTIN_MODELS, "dspark-tiny", tmp_path / "absent" / "target")
    with pytest.raises(FileNotFoundError, match="not in this install.*source checkout"):
        loader.resolve_model_path("dspark-tiny")

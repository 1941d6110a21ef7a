"""Shared fixtures: tiny random Qwen3 and Llama checkpoints built with `transformers`.

Each is a complete Hugging Face directory (config, safetensors, tokenizer with the ChatML
template), so tests exercise the real loader, never a mock.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark.train.tokenizer import save_hf_tokenizer, train_bpe

TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n",
    "Natalia sold clips to 48 of her friends in April. #### 72",
    "Explain list comprehensions in Python. They build lists from iterables.",
]


def build_tiny(out: Path, arch: str, seed: int = 0, **overrides) -> Path:
    import transformers

    tok = train_bpe(TEXT * 4, vocab_size=384)
    save_hf_tokenizer(tok, out, model_max_length=256)
    vocab = tok.get_vocab_size()
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-6, eos_token_id=tok.token_to_id("<|im_end|>"), bos_token_id=None,
    )
    common.update(overrides)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(tie_word_embeddings=True, rope_theta=10000.0, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.LlamaConfig(tie_word_embeddings=False, rope_theta=50000.0, **common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # larger random weights: sharper, less uniform logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(params=["qwen3", "llama"])
def model_dir(request, qwen3_dir, llama_dir) -> Path:
    return qwen3_dir if request.param == "qwen3" else llama_dir

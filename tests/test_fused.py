"""Fused projections (`dspark/models/fused.py`): one product gives what the separate layers give,
the parameters stay the layers' own (checkpoints, loading, training unchanged), and the fused
path steps aside under autograd and after the weights move."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark.config import ModelConfig
from dspark.engine.factory import build_engine
from dspark.models import fused as fused_module
from dspark.models.buckets import bucket
from dspark.models.decoder import Attention, CausalLM
from dspark.models.fused import Product, fuse_projections, packable
from dspark.models.layers import Rotary, SwiGLU, apply_rope
from dspark.models.loader import load_target, save_model


def tiny_config(bias: bool = False) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=bias)


def separate(attn: Attention, x: torch.Tensor) -> list[torch.Tensor]:
    return [p(x) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]


def test_fused_attention_projections_match_the_separate_layers():
    for bias in (False, True):
        torch.manual_seed(0)
        attn, x = Attention(tiny_config(bias)), torch.randn(5, 32)
        with torch.no_grad():
            want = separate(attn, x)
            attn.fuse_projections()
            assert attn.fused is not None and attn.fused.usable()
            got = attn.project(x)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w)
            for g, w in zip(attn.project(x, first=1), want[1:], strict=True):  # k and v alone
                torch.testing.assert_close(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_fused_attention_norms_and_rotates_q_and_k_as_the_separate_path_does(model_type, dtype):
    """Fused, q and k leave one product side by side and are normed and rotated as one tensor of heads;
    each head gets exactly what q_norm/k_norm and RoPE give it apart (given the same projections)."""
    torch.manual_seed(0)
    attn = Attention(dataclasses.replace(tiny_config(), model_type=model_type)).to(dtype)
    if attn.qk_norm:
        with torch.no_grad():  # norms with weights of their own, so a head normed by the wrong one shows
            attn.q_norm.weight.uniform_(0.5, 1.5)
            attn.k_norm.weight.uniform_(0.5, 1.5)
    attn.fuse_projections()
    x, positions = torch.randn(5, 32, dtype=dtype), torch.arange(3, 8)
    cos, sin = Rotary(8, 10000.0, None).cos_sin(positions, x.dtype)
    with torch.no_grad():
        got = attn.qkv(x, cos, sin)
        q, k, v = (t.view(5, -1, 8) for t in attn.fused(x))
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        want = (apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_fused_mlp_matches_the_separate_layers():
    torch.manual_seed(0)
    mlp, x = SwiGLU(32, 48), torch.randn(3, 32)
    with torch.no_grad():
        want = mlp(x)
        mlp.fuse_projections()
        torch.testing.assert_close(mlp(x), want)


def test_fusing_keeps_the_parameters_and_loading_reaches_the_fused_product():
    torch.manual_seed(0)
    net = CausalLM(tiny_config())
    before = {k: v.clone() for k, v in net.state_dict().items()}
    fuse_projections(net)
    after = net.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    torch.manual_seed(1)
    other = CausalLM(tiny_config())
    net.load_state_dict(other.state_dict())  # in place: the fused weights see the new values
    attn, x = net.model.layers[0].self_attn, torch.randn(2, 32)
    with torch.no_grad():
        assert attn.fused is not None and attn.fused.usable()
        for g, w in zip(attn.project(x), separate(other.model.layers[0].self_attn, x), strict=True):
            torch.testing.assert_close(g, w)


def test_gradients_reach_the_layers_and_moved_weights_turn_fusion_off():
    torch.manual_seed(0)
    attn, x = Attention(tiny_config()), torch.randn(4, 32)
    attn.fuse_projections()
    sum(p.sum() for p in attn.project(x)).backward()  # autograd on: the separate layers run
    assert attn.q_proj.weight.grad is not None and attn.v_proj.weight.grad is not None
    attn.to(torch.float64)  # each layer gets new storage: the stacked copy is stale
    assert attn.fused is not None and not attn.fused.usable()
    with torch.no_grad():
        for g, w in zip(attn.project(x.double()), separate(attn, x.double()), strict=True):
            torch.testing.assert_close(g, w)


def test_a_fused_model_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    net = CausalLM(tiny_config())
    fuse_projections(net)
    save_model(net, tmp_path, dtype="float32")  # safetensors refuses tensors that share storage
    back = load_target(tmp_path)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in net.state_dict().items())


def test_the_engine_fuses_the_target_and_its_hidden_states_stay(qwen3_dir):
    engine = build_engine(qwen3_dir, policy="none", profile="off")
    layers = engine.model.model.layers
    assert all(layer.self_attn.fused is not None and layer.mlp.fused is not None for layer in layers)
    ids = engine.encode_prompt("The quick brown fox")
    with torch.no_grad():
        fused = engine.model.forward_dense(torch.tensor([ids]))[0]
        for layer in layers:
            layer.self_attn.fused = layer.mlp.fused = None
        apart = engine.model.forward_dense(torch.tensor([ids]))[0]
    torch.testing.assert_close(fused, apart)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_blocked_product_follows_the_weights(dtype):
    if not fused_module.packable(torch.ones(1, dtype=dtype)):
        pytest.skip(f"no oneDNN {dtype} on this CPU build")
    torch.manual_seed(0)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    net = CausalLM(tiny_config()).to(dtype)
    fuse_projections(net)
    x = torch.randn(3, 32, dtype=dtype)  # three rows: the blocked product in either dtype
    attn = net.model.layers[0].self_attn
    with torch.no_grad():
        for g, w in zip(attn.project(x), separate(attn, x), strict=True):
            torch.testing.assert_close(g, w, atol=tol, rtol=tol)
        net.load_state_dict(CausalLM(tiny_config()).to(dtype).state_dict())  # in place: re-blocked
        for g, w in zip(attn.project(x), separate(attn, x), strict=True):
            torch.testing.assert_close(g, w, atol=tol, rtol=tol)
        head = net.logits(x)
        torch.testing.assert_close(head, net.lm_head(net.model.norm(x)).float(), atol=tol, rtol=tol)


def test_fusing_again_keeps_current_stacks_and_restacks_moved_ones():
    torch.manual_seed(0)
    attn = Attention(tiny_config())
    attn.fuse_projections()  # autograd on: the stack is current, only not usable
    stacked = attn.fused
    attn.fuse_projections()
    assert attn.fused is stacked  # no second stack (its blocked copies are kept)
    attn.to(torch.float64)
    attn.fuse_projections()
    assert attn.fused is not stacked and attn.fused.current()


def test_bucket_sizes_recur_and_pad_little():
    assert [bucket(n) for n in (1, 16, 17, 20, 21, 33, 64, 65, 256, 257)] == [1, 16, 20, 20, 24, 40, 64, 80, 256, 257]
    assert all(n <= bucket(n) <= 1.25 * n for n in range(1, 600))
    assert len({bucket(n) for n in range(17, 257)}) == 16  # four sizes per octave between 16 and 256


@pytest.mark.skipif(not packable(torch.zeros(1, dtype=torch.bfloat16)), reason="blocked products: CPU bfloat16")
def test_a_padded_product_gives_each_row_what_the_row_alone_gets():
    """Rows padded to their bucket (21 -> 24) come back unpadded, each exactly as a one-row product gives it."""
    torch.manual_seed(0)
    w = torch.randn(96, 32, dtype=torch.bfloat16)
    product, x = Product(w, None, [w]), torch.randn(21, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        whole = product(x)
        assert whole.shape == (21, 96)
        for i in (0, 7, 20):
            assert torch.equal(whole[i], product(x[i : i + 1])[0])
        assert torch.equal(product(x.view(3, 7, 32)), whole.view(3, 7, 96))


@pytest.mark.skipif(not packable(torch.zeros(1, dtype=torch.bfloat16)), reason="blocked products: CPU bfloat16")
def test_a_long_reduction_gives_each_row_what_the_row_alone_gets_at_any_number_of_rows():
    """dspark-small's down projection reads 768 inputs: on an AMX CPU oneDNN rounded some rows of a bfloat16 product
    of more than 32 such rows otherwise than the same rows alone, and greedy output under load depended on what
    shared a step. Such products run `ROWS` rows at a time; every row of 1 to 100 equals its one-row product
    (bfloat16, where exactness is the rule; float32's one row takes another kernel, `Product`)."""
    torch.manual_seed(0)
    w = (torch.randn(256, 768) * 0.05).bfloat16()
    product, x = Product(w, None, [w]), torch.randn(100, 768).bfloat16()
    assert product.long and fused_module.ROWS == 32
    with torch.no_grad():
        alone = torch.cat([product(x[i : i + 1]) for i in range(100)])
        for n in (2, 31, 32, 33, 40, 64, 65, 96, 100):
            assert torch.equal(product(x[:n]), alone[:n]), n
        assert torch.equal(product(x.view(4, 25, 768)), alone.view(4, 25, 256))

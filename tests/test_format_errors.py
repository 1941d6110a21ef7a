"""A published drafter that does not fit its target is refused on loading with a ValueError that
names the config key (or the weight) at fault, never a shape error in a forward pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.drafters.registry import load_drafter
from dspark.models.loader import read_config

ROOT = Path(__file__).parent / "fixtures" / "checkpoints"


def copy(tmp_path: Path, name: str, config: dict | None = None, weights: dict | None = None) -> Path:
    """The fixture `name` in tmp_path, with config keys and weights replaced."""
    out = tmp_path / name
    shutil.copytree(ROOT / name, out)
    if config:
        raw = json.loads((out / "config.json").read_text())
        for key, value in config.items():
            *parents, last = key.split(".")
            node = raw
            for p in parents:
                node = node[p]
            node[last] = value
        (out / "config.json").write_text(json.dumps(raw))
    if weights:
        state = load_file(str(out / "model.safetensors"))
        state.update(weights)
        save_file(state, str(out / "model.safetensors"))
    return out


def target(name: str = "target_qwen3", **changes):
    return read_config(ROOT / name).__class__(**{**read_config(ROOT / name).__dict__, **changes})


@pytest.mark.parametrize("name,key", [("deepspec", "hidden_size"), ("dflash", "hidden_size"),
                                      ("speculators_dspark", "transformer_layer_config.hidden_size"),
                                      ("speculators_eagle3", "transformer_layer_config.hidden_size")])
def test_hidden_size_mismatch_names_the_key(name, key):
    with pytest.raises(ValueError, match=f"`{key}`"):
        load_drafter(str(ROOT / name), target=target(hidden_size=64, head_dim=16))


@pytest.mark.parametrize("name,key", [("deepspec", "vocab_size"), ("dflash", "vocab_size"),
                                      ("speculators_dspark", "transformer_layer_config.vocab_size")])
def test_vocabulary_mismatch_names_the_key(name, key):
    with pytest.raises(ValueError, match=f"`{key}`"):
        load_drafter(str(ROOT / name), target=target(vocab_size=300))


def test_eagle_vocabulary_mismatch_names_the_key():
    with pytest.raises(ValueError, match="`vocab_size`"):
        load_drafter(str(ROOT / "eagle"), target=target("target_llama", vocab_size=300))


@pytest.mark.parametrize("name,key,ids", [
    ("deepspec", "target_layer_ids", [0, 1, 4]),
    ("dflash", "dflash_config.target_layer_ids", [1, 9]),
    ("speculators_dspark", "aux_hidden_state_layer_ids", [1, 5]),  # 5 > the target's 4 layers
    ("speculators_dspark", "aux_hidden_state_layer_ids", [3, 1]),  # not increasing
    ("speculators_eagle3", "eagle_aux_hidden_state_layer_ids", [1, 2, 7]),
    ("eagle", "eagle_config.eagle_aux_hidden_state_layer_ids", [1, 2, 6]),
])
def test_target_layer_ids_out_of_range_name_the_key(tmp_path, name, key, ids):
    path = copy(tmp_path, name, {key: ids})
    tgt = "target_llama" if name == "eagle" else "target_qwen3"
    with pytest.raises(ValueError, match=f"`{key}`"):
        load_drafter(str(path), target=read_config(ROOT / tgt))


def test_a_d2t_map_outside_the_vocabulary_is_refused(tmp_path):
    d2t = load_file(str(ROOT / "speculators_eagle3" / "model.safetensors"))["d2t"].clone()
    d2t[-1] += 1000
    path = copy(tmp_path, "speculators_eagle3", weights={"d2t": d2t})
    with pytest.raises(ValueError, match="`d2t`"):
        load_drafter(str(path), target=read_config(ROOT / "target_qwen3"))


def test_a_d2t_map_of_another_size_is_refused(tmp_path):
    path = copy(tmp_path, "speculators_dspark", {"draft_vocab_size": 80})
    with pytest.raises(ValueError, match="`d2t`"):
        load_drafter(str(path), target=read_config(ROOT / "target_qwen3"))


def test_a_t2d_mask_that_disagrees_with_d2t_is_refused(tmp_path):
    t2d = load_file(str(ROOT / "eagle" / "model.safetensors"))["t2d"].clone()
    inside, outside = torch.nonzero(t2d).flatten()[0], torch.nonzero(~t2d).flatten()[0]
    t2d[inside], t2d[outside] = False, True  # as many tokens, not the same ones
    path = copy(tmp_path, "eagle", weights={"t2d": t2d})
    with pytest.raises(ValueError, match="`t2d`"):
        load_drafter(str(path), target=read_config(ROOT / "target_llama"))


def test_a_mask_token_outside_the_vocabulary_is_refused(tmp_path):
    path = copy(tmp_path, "dflash", {"dflash_config.mask_token_id": 999})
    with pytest.raises(ValueError, match="`dflash_config.mask_token_id`"):
        load_drafter(str(path), target=read_config(ROOT / "target_qwen3"))


def test_weights_of_another_shape_than_the_config_are_named(tmp_path):
    path = copy(tmp_path, "deepspec", {"intermediate_size": 96})
    with pytest.raises(ValueError, match="mlp.gate_proj.weight"):
        load_drafter(str(path), target=read_config(ROOT / "target_qwen3"))


def test_the_embeddings_can_be_tapped(tmp_path):
    """DeepSpec's id -1 and speculators' id 0 name the embedding output: dspark taps it as -1."""
    path = copy(tmp_path, "speculators_dspark", {"aux_hidden_state_layer_ids": [0, 3]})
    assert load_drafter(str(path), target=read_config(ROOT / "target_qwen3")).config.taps == (-1, 2)

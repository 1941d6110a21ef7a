"""The target evaluation: repetition-loop detection on constructed sequences, chunked
held-out loss equal to one big forward, and a seconds-long end-to-end run of
`dspark train eval-target` on the tiny random model with a tiny corpus.

    OMP_NUM_THREADS=1 python -m pytest tests/test_evaluate.py -q
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dspark.engine.output import RequestOutput
from dspark.models.loader import load_model
from dspark.models.tokenizer import TextTokenizer
from dspark.train.evaluate import (
    EvalSettings,
    generation_stats,
    is_repetition_loop,
    loop_period,
    render_markdown,
    stream_loss,
)
from dspark.train.target import lm_loss
from dspark.train.tokens import encode_corpus, heldout_windows


# ---- is_repetition_loop ---------------------------------------------------------------
@pytest.mark.parametrize("period", [1, 2, 3, 7, 31, 32])
def test_periodic_tail_is_a_loop(period):
    noise = list(range(1000, 1050))  # a non-repeating start does not matter
    unit = list(range(period))
    tokens = noise + unit * (200 // period)
    assert is_repetition_loop(tokens)
    assert loop_period(tokens) == period


def test_period_above_max_is_not_a_loop():
    tokens = list(range(33)) * 4
    assert not is_repetition_loop(tokens)
    assert is_repetition_loop(tokens, max_period=33)


def test_smallest_period_is_reported():
    assert loop_period([5, 6] * 60) == 2  # also periodic with 4, 6, ...


def test_needs_a_full_window():
    tokens = [1, 2, 3] * 40
    assert is_repetition_loop(tokens[:96])
    assert not is_repetition_loop(tokens[:95])
    assert not is_repetition_loop([])


def test_one_break_inside_the_window_is_not_a_loop():
    tokens = [1, 2, 3, 4] * 40
    for pos in (-1, -50, -96):
        broken = list(tokens)
        broken[pos] = 99
        assert not is_repetition_loop(broken), pos
    broken = list(tokens)
    broken[-97] = 99  # just outside the window
    assert is_repetition_loop(broken)


def test_non_periodic_sequences():
    rng = np.random.default_rng(0)
    assert not is_repetition_loop(rng.integers(0, 8192, 300).tolist())
    assert not is_repetition_loop(list(range(300)))


def test_repeated_line_of_tokens_counts():
    line = [11, 12, 13, 14, 15, 198]  # a short line ending in a newline token
    assert is_repetition_loop([7, 8, 9] + line * 20)


def test_period_must_fit_twice_and_arguments_checked():
    tokens = list(range(8))
    assert not is_repetition_loop(tokens, window=8, max_period=32)  # p=8 would be vacuous
    assert is_repetition_loop([1, 2, 1, 2], window=4, max_period=32)
    assert is_repetition_loop(np.array([4, 4, 4, 4]), window=4)
    with pytest.raises(ValueError):
        is_repetition_loop(tokens, window=1)
    with pytest.raises(ValueError):
        is_repetition_loop(tokens, max_period=0)


def test_generation_stats_counts_loops_only_without_eos():
    def out(ids, finish, text=""):
        return RequestOutput("r", [1], text, ids, finish, {})

    outs = [out([3, 4] * 60, "length"),  # a loop
            out([3, 4] * 60 + [0], "stop"),  # repeated, but it stopped: not a loop
            out(list(range(120)), "length", "#### 5"),
            out([9] * 10, "stop")]  # short
    g = generation_stats(outs, "math", EvalSettings())
    assert g["loop_rate"] == 0.25 and g["stop_rate"] == 0.5 and g["answer_marker_rate"] == 0.25
    assert g["mean_tokens"] == (120 + 121 + 120 + 10) / 4
    assert [p["loop_period"] for p in g["per_prompt"]] == [2, None, None, None]
    assert "answer_marker_rate" not in generation_stats(outs, "chat", EvalSettings())


# ---- held-out loss --------------------------------------------------------------------
def test_chunked_loss_equals_one_forward(qwen3_dir):
    net, _ = load_model(qwen3_dir)
    stream = np.random.default_rng(0).integers(0, net.config.vocab_size, 2000).astype(np.uint16)
    got = stream_loss(net, stream, seq_len=32, windows=6, batch=4)  # chunks of 4 and 2
    with torch.no_grad():
        want = float(lm_loss(net, heldout_windows(stream, 32, 6)))
    assert got["windows"] == 6 and got["seq_len"] == 32
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(want), rel=1e-5)


# ---- end to end -----------------------------------------------------------------------
def tiny_corpus(root):
    records = {
        "math": [{"domain": "math", "prompt": f"Tom has {i} apples and buys {i + 2}. How many?",
                  "response": f"He has {i} + {i + 2} = {2 * i + 2} apples.\n#### {2 * i + 2}"} for i in range(4)],
        "code": [{"domain": "code", "text": "def add(a, b):\n    return a + b\n" * 6}]
        + [{"domain": "code", "prompt": f"Complete the following Python function:\n```python\ndef f{i}(x):\n```",
            "response": f"```python\ndef f{i}(x):\n    return x * {i}\n```"} for i in range(3)],
        "chat": [{"domain": "chat", "prompt": f"Explain topic {i}.",
                  "response": "The quick brown fox jumps over the lazy dog. " * (i + 1)} for i in range(3)],
        "agent": [{"domain": "agent", "kind": "tool_call", "prompt": f"Call get_weather for city {i}.",
                   "response": json.dumps({"name": "get_weather", "arguments": {"city": str(i)}})} for i in range(3)],
    }
    corpus = root / "corpus"
    corpus.mkdir()
    for domain, recs in records.items():
        for split in ("train", "heldout"):
            (corpus / f"{domain}.{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return corpus


def test_corpus_without_agent_domain_still_encodes(qwen3_dir, tmp_path):
    """A corpus built before the agent domain existed tokenises its three domains."""
    corpus = tiny_corpus(tmp_path)
    for split in ("train", "heldout"):
        (corpus / f"agent.{split}.jsonl").unlink()
    counts = encode_corpus(corpus, TextTokenizer.from_dir(qwen3_dir).tok, tmp_path / "tokens")
    assert set(counts) == {"math", "code", "chat"}


def test_eval_target_end_to_end(qwen3_dir, tmp_path, capsys):
    from dspark.cli import main

    corpus = tiny_corpus(tmp_path)
    encode_corpus(corpus, TextTokenizer.from_dir(qwen3_dir).tok, tmp_path / "tokens")
    out = tmp_path / "eval.json"
    assert main(["train", "eval-target", "--model", str(qwen3_dir), "--corpus", str(corpus),
                 "--tokens", str(tmp_path / "tokens"), "--num-prompts", "2", "--max-tokens", "16",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["heldout_loss"]) == {"math", "code", "chat", "agent"}
    for v in result["heldout_loss"].values():
        assert math.isfinite(v["loss"]) and v["loss"] > 0
    for domain, g in result["generation"].items():
        assert g["prompts"] == 2
        assert g["loop_rate"] == 0.0  # 16 tokens never fill a 96-token window
        assert 0.0 <= g["stop_rate"] <= 1.0 and 1 <= g["mean_tokens"] <= 16
        assert ("answer_marker_rate" in g) == (domain == "math")
    assert [s["domain"] for s in result["samples"]] == ["math", "code", "chat", "agent"]
    tool = result["agent_tasks"]["tool_call"]
    assert tool["prompts"] == 2 and 0.0 <= tool["solved"] <= tool["valid_json"] <= 1.0
    assert result["samples"][0]["prompt"].startswith("Tom has 0 apples")
    printed = capsys.readouterr().out
    assert printed.strip() == render_markdown(result).strip()
    for heading in ("### Held-out loss", "### Greedy generations", "### Agent tasks", "### Samples", "#### code"):
        assert heading in printed

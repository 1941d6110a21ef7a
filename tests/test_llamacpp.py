"""llama.cpp as a peer (bench/llamacpp.py): its printed timings are read right, a missing build or model is a
clear error, and (where DSPARK_LLAMA_CPP names a built tree) a converted model really runs."""

import os
from pathlib import Path

import pytest

from dspark.bench import llamacpp

COMPLETION_LOG = """
llama_perf_sampler_print:    sampling time =      12.01 ms /   160 runs   (    0.08 ms per token, 13322.23 tokens per second)
common_perf_print:        load time =     130.22 ms
common_perf_print: prompt eval time =      41.50 ms /    32 tokens (    1.30 ms per token,   771.08 tokens per second)
common_perf_print:        eval time =    2540.75 ms /   127 runs   (   20.01 ms per token,    49.99 tokens per second)
common_perf_print:       total time =    2610.33 ms /   159 tokens
common_perf_print: unaccounted time =      16.07 ms /   0.6 %      (total - sampling - prompt eval - eval) / (total)
"""

SPECULATIVE_LOG = """
encoded   32 tokens in    0.045 seconds, speed:  711.111 t/s
decoded  131 tokens in    1.900 seconds, speed:   68.947 t/s

n_draft   = 7
n_predict = 131
n_drafted = 210
n_accept  = 98
accept    = 46.667%
"""


def test_completion_timing_is_its_total():
    seconds, prompt, runs = llamacpp.parse_completion(COMPLETION_LOG)
    assert seconds == pytest.approx(2.61033)
    assert (prompt, runs) == (32, 127)


def test_speculative_timing_adds_prompt_and_decode():
    seconds, prompt, decoded, accept = llamacpp.parse_speculative(SPECULATIVE_LOG)
    assert seconds == pytest.approx(1.945)
    assert (prompt, decoded) == (32, 131)
    assert accept == pytest.approx(0.46667)


def test_log_without_timing_is_an_error():
    with pytest.raises(RuntimeError, match="no timing of the prompt"):
        llamacpp.parse_completion("error: model not found\n")
    with pytest.raises(RuntimeError, match="no prompt timing"):
        llamacpp.parse_speculative(COMPLETION_LOG)


def test_missing_build_and_model_are_clear(tmp_path):
    ll = llamacpp.LlamaCpp(tmp_path)
    with pytest.raises(FileNotFoundError, match="build llama.cpp"):
        ll.binary("llama-completion")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        llamacpp.gguf(ll, tmp_path)


@pytest.mark.skipif(not os.environ.get("DSPARK_LLAMA_CPP"), reason="set DSPARK_LLAMA_CPP to a built llama.cpp tree")
def test_converted_model_runs(tmp_path, qwen3_dir):
    from dspark.models.tokenizer import TextTokenizer

    ll = llamacpp.LlamaCpp(Path(os.environ["DSPARK_LLAMA_CPP"]))
    model = llamacpp.gguf(ll, Path(qwen3_dir), cache=tmp_path)
    tok = TextTokenizer.from_dir(qwen3_dir)
    ids = tok.encode("def add(a, b):")
    plain = llamacpp.plain(ll, model, tok, 16)(ids)
    spec = llamacpp.speculative(ll, model, model, tok, 16)(ids)
    assert plain.tokens == 16 and plain.seconds > 0
    assert spec.tokens >= 16 and spec.seconds > 0
    accept = spec.extra["accept"]
    assert accept != accept or accept > 0.9  # a model drafting for itself (nan: its draft confidence never passed)


def test_a_run_whose_log_lost_its_timing_is_run_again(tmp_path):
    """A run whose log lacks the timing summary is run again (up to three runs in all) before the error stands."""
    calls, log = tmp_path / "calls", tmp_path / "log.txt"
    log.write_text(COMPLETION_LOG)
    late, never = tmp_path / "late", tmp_path / "never"
    late.write_text(f"#!/bin/sh\necho x >> {calls}\n[ $(wc -l < {calls}) -ge 2 ] && cat {log} >&2\nexit 0\n")
    never.write_text(f"#!/bin/sh\necho x >> {calls}\n")
    late.chmod(0o755)
    never.chmod(0o755)
    _, (seconds, prompt, runs) = llamacpp.parsed_run([str(late)], llamacpp.parse_completion)
    assert calls.read_text().count("x") == 2 and (prompt, runs) == (32, 127)
    calls.unlink()
    with pytest.raises(RuntimeError, match="no timing of the prompt"):
        llamacpp.parsed_run([str(never)], llamacpp.parse_completion)
    assert calls.read_text().count("x") == 3

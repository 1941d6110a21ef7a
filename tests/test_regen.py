"""`dspark train regen`: sampled and greedy answers of the target, resumable.

The conftest's tiny random model answers a three-prompt-per-domain corpus; greedy answers must be
what plain greedy decoding of the same prompt emits (a drafter trained on them for greedy serving
learns exactly the text it will be asked to draft).
"""

from __future__ import annotations

import json

import pytest

from dspark.sampling import SamplingParams
from dspark.train.regen import answer_params, regenerate
from tests.test_ddp import write_corpus


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_greedy_answers_are_plain_greedy_decoding_and_say_their_temperature(qwen3_dir, tmp_path):
    from dspark import LLM

    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "greedy.jsonl"
    assert regenerate(str(qwen3_dir), str(corpus), str(out), "heldout", per_domain=2, max_tokens=12, batch=3,
                      temperature=0.0) == 8
    rows = read(out)
    assert len(rows) == 8 and {r["temperature"] for r in rows} == {0.0}
    llm = LLM(str(qwen3_dir), drafter="none", policy="none")
    plain = llm.generate([r["prompt_ids"] for r in rows], SamplingParams(temperature=0, max_tokens=12))
    assert [r["response_ids"] for r in rows] == [list(o.token_ids) for o in plain]


def test_an_interrupted_run_resumes_after_its_last_row(qwen3_dir, tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "sampled.jsonl"
    regenerate(str(qwen3_dir), str(corpus), str(out), "train", per_domain=3, max_tokens=8, batch=4, seed=5)
    whole = read(out)
    out.write_text("".join(json.dumps(r) + "\n" for r in whole[:4]))  # stopped after the first batch
    regenerate(str(qwen3_dir), str(corpus), str(out), "train", per_domain=3, max_tokens=8, batch=4, seed=5)
    assert read(out) == whole  # seeded per prompt: the resumed rows are the ones the whole run wrote
    assert {r["temperature"] for r in whole} == {0.7}


def test_answer_settings():
    greedy = answer_params(0.0, 16, 3)
    assert greedy.greedy and greedy.max_tokens == 16
    warm = answer_params(0.7, 16, 3)
    assert (warm.temperature, warm.top_p, warm.top_k, warm.seed) == (0.7, 0.8, 20, 3)


def test_a_negative_temperature_fails_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="temperature"):
        regenerate(str(tmp_path / "no-model"), str(tmp_path), str(tmp_path / "x.jsonl"), temperature=-1.0)
    assert not (tmp_path / "x.jsonl").exists()


def test_an_unknown_style_fails_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="unknown prompt style"):
        regenerate(str(tmp_path / "no-model"), str(tmp_path), str(tmp_path / "x.jsonl"), style="exam")
    assert not (tmp_path / "x.jsonl").exists()


def test_domains_restrict_the_prompts_and_an_unknown_one_fails_before_the_model_loads(tmp_path):
    from dspark.train.regen import chat_prompts

    corpus = write_corpus(tmp_path / "corpus")
    every = chat_prompts(corpus, "train", 3, seed=2)
    code = chat_prompts(corpus, "train", 3, seed=2, domains=["code"])
    assert {d for d, _ in every} > {"code"} and code and {d for d, _ in code} == {"code"}
    assert code == [(d, p) for d, p in every if d == "code"]  # corpus wording draws no randomness
    with pytest.raises(ValueError, match="unknown domains poetry"):
        regenerate(str(tmp_path / "no-model"), str(corpus), str(tmp_path / "x.jsonl"), domains=["code", "poetry"])
    assert not (tmp_path / "x.jsonl").exists()

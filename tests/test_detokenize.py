"""Incremental detokenization (`models/detokenize.py`) is a full decode, done token by token.

At every prefix of random id sequences (special tokens and lone UTF-8 bytes included) the
detokenizer's final text equals `TextTokenizer.decode`; multi-byte characters split across
tokens appear only once whole; stop strings spanning tokens cut the text where a full decode
finds them. The engine and the streamed server text use it, and decode work stays linear in
the output: a tokenizer that counts the ids it decodes sees O(tokens), not O(tokens^2).
"""

from __future__ import annotations

import random

import pytest
import torch

from dspark.config import EngineConfig
from dspark.engine.engine import LLMEngine
from dspark.engine.factory import assemble
from dspark.models.detokenize import CONTEXT, LIMIT, Detokenizer
from dspark.models.loader import load_model
from dspark.models.tokenizer import TextTokenizer
from dspark.sampling import SamplingParams

WORLD = "naïve café, 世界 🙂 ok"


class CountingTokenizer(TextTokenizer):
    """The real tokenizer; it also counts the ids its `decode` is asked for."""

    def __init__(self, base: TextTokenizer) -> None:
        super().__init__(base.tok, base.config, base.eos_token_ids)
        self.decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


@pytest.fixture(scope="module")
def tiny(qwen3_dir):
    return load_model(qwen3_dir)


def shipped_tokenizer() -> TextTokenizer:
    from dspark.models.loader import resolve_model_path

    return TextTokenizer.from_dir(resolve_model_path(None))


@pytest.mark.parametrize("which", ["tiny", "shipped"])
def test_text_equals_a_full_decode_at_every_prefix(tiny, which):
    tok = tiny[1] if which == "tiny" else shipped_tokenizer()
    rng = random.Random(0)
    specials = [t for t in (tok.token_id("<|im_end|>"), tok.token_id("<|im_start|>")) if t is not None]
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        ids += [specials[0]] if rng.random() < 0.5 else []
        ids = [t if rng.random() > 0.1 else rng.choice(specials) for t in ids]
        detok = Detokenizer(tok)
        for n, t in enumerate(ids, 1):
            detok.push(t)
            assert detok.final(ids[:n]) == tok.decode(ids[:n])
            assert tok.decode(ids[:n]).startswith(detok.text)


@pytest.mark.parametrize("which", ["tiny", "shipped"])
def test_multibyte_characters_split_across_tokens(tiny, which):
    tok = tiny[1] if which == "tiny" else shipped_tokenizer()
    ids = tok.encode(WORLD)
    detok = Detokenizer(tok)
    pieces = [detok.push(t) for t in ids]
    assert "" in pieces  # some token ends inside a character: nothing is shown for it yet
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) == detok.final(ids) == tok.decode(ids) == WORLD
    cut = Detokenizer(tok)  # an output that stops inside a character decodes as a full decode does
    for t in ids[:-1]:
        cut.push(t)
    assert cut.final(ids[:-1]) == tok.decode(ids[:-1])


def test_stop_strings_spanning_tokens_cut_where_a_full_decode_finds_them(tiny):
    tok = tiny[1]
    ids = tok.encode("def add(a, b):\n    return a + b\n" + WORLD)
    text = tok.decode(ids)
    bounds = [len(tok.decode(ids[:n])) for n in range(1, len(ids))]
    for start in (b - 1 for b in bounds[3:12]):  # each begins one character before a token boundary
        for stop in (text[start : start + 3], text[start : start + 2]):
            detok, n = Detokenizer(tok, (stop, "never there")), 0
            while detok.stop_at is None:
                detok.push(ids[n])
                n += 1
            assert stop in tok.decode(ids[:n]) and stop not in tok.decode(ids[: n - 1])
            assert detok.final(ids[:n]) == text[: text.find(stop)]


def engine(tiny, tokenizer=None) -> LLMEngine:
    net, tok = tiny
    return assemble(net, tokenizer or tok, EngineConfig(device="cpu", block_size=4))


def test_engine_text_and_stop_strings_match_a_full_decode(tiny):
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    eng = engine(tiny)
    prompts = ["The quick brown fox", "def add(a, b):"]
    full = eng.run_until_done([eng.add_request(p, params) for p in prompts])
    for p, out in zip(prompts, full, strict=True):
        assert out.text == tiny[1].decode(out.token_ids)
        mid = len(tiny[1].decode(out.token_ids[:30]))
        stop = out.text[mid - 2 : mid + 2]  # spans the 30th token's end
        if len(stop) < 4 or not stop.strip():
            continue
        eng2 = engine(tiny)
        cut = eng2.run_until_done([eng2.add_request(p, SamplingParams(**{**params.__dict__, "stop": (stop,)}))])[0]
        assert cut.finish_reason == "stop"
        assert cut.text == out.text[: out.text.find(stop)]
        assert cut.token_ids == out.token_ids[: len(cut.token_ids)]


def test_engine_decodes_each_token_a_bounded_number_of_times(tiny):
    """Stop strings once decoded the whole output per emitted token (quadratic)."""
    tok = CountingTokenizer(tiny[1])
    eng = engine(tiny, tok)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, stop=("never there", "nor this"))
    reqs = [eng.add_request(p, params) for p in ("The quick brown fox", "def add(a, b):")]
    outs = eng.run_until_done(reqs)
    emitted = sum(len(o.token_ids) for o in outs)
    assert emitted == 400
    assert tok.decoded <= 2 * (CONTEXT + LIMIT + 1) * emitted  # once: 200 * 201 per request
    assert all(o.text == tiny[1].decode(o.token_ids) for o in outs)


def test_request_tokens_grow_in_place(tiny):
    eng = engine(tiny)
    req = eng.add_request("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=5))
    seen = req.all_ids
    eng.run_until_done([req])
    assert req.all_ids is seen and seen == req.prompt_ids + req.output_ids


def test_streamed_text_is_the_full_text_and_decodes_linearly(tiny):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    import json

    from dspark.server.app import ServeSettings, create_app
    from dspark.server.launch import ServerThread

    tok = CountingTokenizer(tiny[1])
    torch.manual_seed(0)
    app = create_app(engine(tiny, tok), ServeSettings(model_name="tiny"))
    body = {"prompt": "The quick brown fox", "max_tokens": 150, "temperature": 0, "ignore_eos": True}
    with ServerThread(app) as srv:
        whole = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        stop = whole[40:43]
        for extra in ({}, {"stop": ["never there"]}, {"stop": [stop]}):
            tok.decoded = 0
            with httpx.stream("POST", srv.url + "/v1/completions", json={**body, **extra, "stream": True},
                              timeout=60) as reply:
                lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
            streamed = "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1])
            expect = whole[: whole.find(stop)] if extra.get("stop") == [stop] else whole
            assert streamed == expect, extra
            assert tok.decoded <= 2 * (CONTEXT + LIMIT + 1) * 150


@pytest.mark.parametrize("which", ["tiny", "shipped"])
def test_runs_of_invalid_bytes_keep_the_window_short(tiny, which):
    """Lone bytes (which decode to U+FFFD) mixed with the pieces of multi-byte characters:
    still a full decode at every prefix, and the decoded window stays a few ids long."""
    tok = tiny[1] if which == "tiny" else shipped_tokenizer()
    invalid = [t for t in range(tok.vocab_size) if tok.decode([t]) == "\ufffd"][:6]
    assert invalid
    pool = invalid + tok.encode(WORLD)
    rng = random.Random(1)
    longest = 0
    for _ in range(10):
        ids = [rng.choice(pool) for _ in range(60)] + [invalid[0]] * 30
        detok = Detokenizer(tok, ("\ufffd\ufffd\ufffd\ufffd\ufffd",))
        for n, t in enumerate(ids, 1):
            detok.push(t)
            longest = max(longest, len(detok.pending))
            if detok.stop_at is None:
                assert detok.final(ids[:n]) == tok.decode(ids[:n])
        assert detok.stop_at is not None  # found in the shown text, as a full decode finds it
        assert detok.final(ids) == tok.decode(ids)[: tok.decode(ids).find("\ufffd" * 5)]
    assert longest <= LIMIT + 1


def test_pad_id_is_end_of_text_where_the_vocabulary_has_it():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    with_eot = TextTokenizer(Tokenizer(WordLevel({"a": 0, "<|endoftext|>": 5}, unk_token="a")), {}, ())
    without = TextTokenizer(Tokenizer(WordLevel({"a": 0, "b": 1}, unk_token="a")), {}, ())
    assert with_eot.pad_id == 5 and without.pad_id == 0

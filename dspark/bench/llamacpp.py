"""llama.cpp as a peer in `dspark bench peers --llama-cpp DIR`: its plain decoding and its speculative decoding
with a draft model, on the same checkpoints converted to GGUF, the same prompts and the same number of new tokens.

DIR is a llama.cpp source tree with its examples built, e.g. the one vendored in the `llama-cpp-python` sdist:

    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build -j --target llama-completion llama-speculative-simple

Models are converted once with DIR's own `convert_hf_to_gguf.py` into `~/.cache/dspark/gguf/`. The converter
names a BPE pre-tokenizer by hashing how the tokenizer splits a test string and does not know dspark's (a
byte-level BPE with GPT-2's split rule), so it is told `gpt-2` (and not to look for a SentencePiece model);
the report gives llama.cpp's prompt lengths beside dspark's so any difference in tokenisation shows. Times are llama.cpp's own (prompt evaluation plus
decoding, model loading excluded), as this engine's are. `--ignore-eos` in llama.cpp bans the end token (the
engine here emits it and goes on), so a prompt where the model would end early continues differently there.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Measured:
    """One generation timed by the system that ran it (load time excluded)."""

    seconds: float
    tokens: int
    ids: list[int]  # its text in this project's token ids, for the greedy-match check
    extra: dict


CONVERT = """
import sys
sys.path[:0] = ["gguf-py", "."]
import convert_hf_to_gguf as c
try:  # newer trees keep the model classes in a `conversion` package
    from conversion.base import TextModel
except ImportError:
    TextModel = c.TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
def no_sentencepiece(self, *args, **kwargs):  # byte-level BPE: the converter falls back to its GPT-2 vocab path
    raise FileNotFoundError("no SentencePiece model")
TextModel._set_vocab_sentencepiece = no_sentencepiece
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
c.main()
"""


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp tree and how to run it."""

    root: Path
    threads: int = 2
    draft_max: int = 7  # draft tokens per step (llama.cpp's --spec-draft-n-max)
    outtype: str = "f32"  # GGUF weight type; f32 matches this engine's CPU default

    def binary(self, name: str) -> Path:
        path = self.root / "build" / "bin" / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: build llama.cpp's examples in {self.root} "
                                    f"(cmake --build build --target llama-completion llama-speculative-simple)")
        return path


def gguf(ll: LlamaCpp, model_dir: Path, cache: Path | None = None) -> Path:
    """The model at model_dir as GGUF, converted on first use and cached by its weights' size and time."""
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors to convert")
    stamp = "|".join(f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights)
    key = hashlib.sha1(f"{model_dir.resolve()}|{stamp}".encode()).hexdigest()[:12]
    out = (cache or Path.home() / ".cache" / "dspark" / "gguf") / f"{model_dir.name}-{key}-{ll.outtype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_suffix(".part")
        done = subprocess.run([sys.executable, "-c", CONVERT, str(model_dir), "--outfile", str(part),
                               "--outtype", ll.outtype], cwd=ll.root, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"GGUF conversion of {model_dir} failed:\n{done.stderr[-2000:]}")
        part.rename(out)
    return out


def _find(pattern: str, log: str, what: str) -> re.Match:
    found = re.search(pattern, log)
    if found is None:
        raise RuntimeError(f"llama.cpp printed no {what} ({pattern!r}):\n{log[-1500:]}")
    return found


def parse_completion(log: str) -> tuple[float, int, int]:
    """llama-completion's perf lines -> (seconds from its timer reset before the prompt to the end: prompt,
    decoding, sampling and host work, as the engine here is timed), prompt tokens, decode runs."""
    prompt_n = int(_find(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens", log, "timing of the prompt").group(1))
    runs = int(_find(r"(?<!prompt )eval time =\s*[\d.]+ ms /\s*(\d+) runs", log, "timing of decoding").group(1))
    total = float(_find(r"total time =\s*([\d.]+) ms", log, "timing in total").group(1)) / 1e3
    return total, prompt_n, runs


def parse_speculative(log: str) -> tuple[float, int, int, float]:
    """llama-speculative-simple's summary -> (prompt + decode seconds, prompt tokens, tokens decoded,
    draft acceptance rate)."""
    enc = _find(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", log, "prompt timing")
    dec = _find(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log, "decode timing")
    accept = re.search(r"accept\s*=\s*([\d.]+)%", log)
    return (float(enc.group(2)) + float(dec.group(2)), int(enc.group(1)), int(dec.group(1)),
            float(accept.group(1)) / 100 if accept else float("nan"))


def _common(ll: LlamaCpp, model: Path, prompt: str, max_tokens: int, stop_at_eos: bool = False) -> list[str]:
    eos = [] if stop_at_eos else ["--ignore-eos"]
    return ["-m", str(model), "-p", prompt, "-n", str(max_tokens), *eos, "--temp", "0", "--top-k", "1",
            "--seed", "0", "-t", str(ll.threads), "-tb", str(ll.threads), "-c", "2048", "-ngl", "0",
            "-lv", "3"]  # log level 3: the timing summaries are info lines


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                          env={**os.environ, "LLAMA_LOG_COLORS": "0"})
    if done.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done


def parsed_run(cmd: list[str], parse, tries: int = 3):
    """(the finished run, `parse` of its log). Now and then a run's timing summary is missing from
    its log (once in 36 runs of `dspark bench peers` here, the run otherwise complete): such a run is
    run again, up to `tries` times in all, before the error stands."""
    for attempt in range(tries):
        done = _run(cmd)
        try:
            return done, parse(done.stderr)
        except RuntimeError:
            if attempt + 1 == tries:
                raise
    raise ValueError("tries must be at least 1")


def plain(ll: LlamaCpp, model: Path, tokenizer, max_tokens: int, stop_at_eos: bool = False):
    """prompt ids -> Measured, llama.cpp decoding one token per step (llama-completion); with stop_at_eos it
    stops at the end token, and its tokens are its text's, the end token counted as the others count it."""
    exe = ll.binary("llama-completion")

    def generate(ids: list[int]) -> Measured:
        prompt = tokenizer.decode(ids, skip_special_tokens=False)
        done, (seconds, prompt_n, runs) = parsed_run([str(exe), *_common(ll, model, prompt, max_tokens, stop_at_eos),
                                                      "-no-cnv", "--no-display-prompt"], parse_completion)
        out = tokenizer.encode(done.stdout)[:max_tokens]
        tokens = min(max_tokens, len(out) + 1) if stop_at_eos else max_tokens  # the end token, as the others count it
        return Measured(seconds, tokens, out, {"prompt_tokens": prompt_n})

    return generate


def speculative(ll: LlamaCpp, model: Path, draft: Path, tokenizer, max_tokens: int, stop_at_eos: bool = False):
    """prompt ids -> Measured, llama.cpp's speculative decoding with a draft model (llama-speculative-simple)."""
    exe = ll.binary("llama-speculative-simple")

    def generate(ids: list[int]) -> Measured:
        prompt = tokenizer.decode(ids, skip_special_tokens=False)
        done, (seconds, prompt_n, decoded, accept) = parsed_run(
            [str(exe), *_common(ll, model, prompt, max_tokens, stop_at_eos), "-md", str(draft), "-ngld", "0",
             "--spec-type", "draft-simple", "--spec-draft-n-max", str(ll.draft_max)], parse_speculative)
        text = done.stdout.lstrip("\n")
        text = text[len(prompt):] if text.startswith(prompt) else ""
        return Measured(seconds, decoded, tokenizer.encode(text)[:max_tokens],
                        {"prompt_tokens": prompt_n, "accept": accept})

    return generate

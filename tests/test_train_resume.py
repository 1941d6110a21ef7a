"""Exact resume: a training run killed with SIGKILL mid-run and started again ends with the
same weights as a run that was never interrupted (same data order, same optimizer state)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.train.corpus import DOMAINS
from dspark.train.tokenizer import save_hf_tokenizer, train_bpe
from tests.conftest import TEXT

SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from dspark.train.target import TargetTrainConfig, train
train(TargetTrainConfig.from_file(sys.argv[1]))
"""
# the run to be killed stops inside step 13 (its log row written, its checkpoint not) and says
# so: the test kills it there, at the same point on any machine, instead of after a poll
PAUSED_AT_13 = """
import sys, threading, torch
from pathlib import Path
torch.set_num_threads(1)
import dspark.train.target as target
real_log = target.append_log
def append_log(run_dir, row):
    real_log(run_dir, row)
    if row["step"] == 13:
        Path(sys.argv[2]).touch()
        threading.Event().wait()
target.append_log = append_log
target.train(target.TargetTrainConfig.from_file(sys.argv[1]))
"""


def tiny_run(tmp: Path, name: str) -> Path:
    tok = train_bpe(TEXT * 4, vocab_size=384)
    save_hf_tokenizer(tok, tmp / "tok")
    (tmp / "tokens").mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for d in DOMAINS:
        for split in ("train", "heldout"):
            np.save(tmp / "tokens" / f"{d}.{split}.npy", rng.integers(0, 384, 4000).astype(np.uint16))
    cfg = tmp / f"{name}.toml"
    cfg.write_text(f"""
tokens_dir = "{tmp / 'tokens'}"
tokenizer_dir = "{tmp / 'tok'}"
run_dir = "{tmp / name}"
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 16
seq_len = 32
batch_size = 2
max_steps = 40
warmup_steps = 4
eval_every = 1000
compile = false
checkpoint_minutes = 0.0
""")
    return cfg


def final_weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)["model"]


@pytest.mark.slow
def test_target_training_resumes_exactly_after_kill(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight = tiny_run(tmp_path, "straight")
    subprocess.run([sys.executable, "-c", SCRIPT, str(straight)], check=True, env=env, capture_output=True)
    killed = tiny_run(tmp_path, "killed")
    paused = tmp_path / "paused"
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_AT_13, str(killed), str(paused)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300  # a safety net for a broken run, not a verdict on speed
    while not paused.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run never reached step 13"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=False)["step"] == 12
    assert len((tmp_path / "killed" / "log.jsonl").read_text().splitlines()) == 13  # killed mid-step 13
    subprocess.run([sys.executable, "-c", SCRIPT, str(killed)], check=True, env=env, capture_output=True)
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "killed")
    assert all(torch.equal(a[k], b[k]) for k in a)

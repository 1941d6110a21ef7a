"""`dspark generate ... | head`: a reader that leaves early ends the command quietly (exit 141, as a
shell reports a tool a closed pipe stopped), never with a traceback."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_closed_pipe_ends_generate_quietly(qwen3_dir):
    cmd = [sys.executable, "-m", "dspark", "generate", "--model", str(qwen3_dir), "--policy", "none",
           "--max-tokens", "4", "--json", "The quick brown fox"]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command starts: its first write meets a closed pipe
    try:
        proc = subprocess.Popen(cmd, stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()

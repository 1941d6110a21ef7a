"""Soak: `dspark serve` under mixed load for a long time; its RSS and KV pool must stay flat.

    dspark bench soak --duration 1200            # 20 minutes; report in docs/results/soak/
    dspark bench soak --quick                    # 60 s smoke run, report in /tmp

The server runs as a child process (so its RSS is the server's alone) with a KV pool small
enough to preempt. C clients send requests until the duration is over, client c cycling
through the kinds from offset c (so every kind runs from the first round on):

- stream / full / chat: read to the end (streamed, not streamed, streamed chat);
- stream-leave: a streamed request whose client leaves after a few chunks;
- full-leave: a non-streamed request whose client gives up after a short wait;
- bad: a bad body (broken JSON, unknown field, out-of-range value, unknown model, too-long
  prompt, out-of-vocabulary token id) that must get its exact 4xx.

Leaving and bad bodies are the deliberate faults. An error is anything else: a 5xx, an
unexpected status, an error chunk, a stream without [DONE], a transport failure. Every
`sample_every_s` the server's RSS (psutil) and its KV blocks in use and requests running and
waiting (/metrics) are sampled; after the load the server must go idle with every block free.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

KINDS = ("stream", "full", "chat", "stream-leave", "full-leave", "bad")
PROMPTS = ["The quick brown fox", "def add(a, b):\n", "Natalia sold clips to 48 of her friends",
           "Explain list comprehensions.", "Once upon a time", "import numpy as np\n"]
BAD = [  # (path, body, the status it must get)
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400),
    ("/v1/completions", {"prompt": "x", "temperature": 7}, 400),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404),
    ("/v1/completions", {"prompt": "word " * 4000}, 400),
    ("/v1/completions", {"prompt": [10**6]}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
]
GAUGES = ("dspark_kv_blocks_used", "dspark_kv_blocks_free", "dspark_requests_running", "dspark_requests_waiting")


@dataclass(frozen=True)
class SoakSettings:
    model: str | None = None  # default: the shipped default model
    device: str | None = None  # default: cuda when available
    duration_s: float = 1200.0
    clients: int = 12
    max_tokens: int = 48
    num_kv_blocks: int = 16  # small: concurrent requests outgrow it, so the scheduler preempts
    sample_every_s: float = 10.0
    drafter: str | None = None
    policy: str | None = None
    seed: int = 0
    startup_timeout_s: float = 600.0


@dataclass
class Tally:
    """What the clients saw, per kind; `problems` holds the first errors verbatim."""

    counts: dict[str, dict[str, int]] = field(default_factory=lambda: {k: {"sent": 0, "ok": 0, "left": 0,
                                                                            "errors": 0} for k in KINDS})
    problems: list[str] = field(default_factory=list)

    def record(self, kind: str, outcome: str) -> None:
        row = self.counts[kind]
        row["sent"] += 1
        if outcome in ("ok", "left"):
            row[outcome] += 1
        else:
            row["errors"] += 1
            if len(self.problems) < 50:
                self.problems.append(f"{kind}: {outcome}")

    @property
    def errors(self) -> int:
        return sum(row["errors"] for row in self.counts.values())


# ---- one request of each kind: -> "ok", "left" (a deliberate disconnect) or what went wrong --
def body_for(kind: str, rng: random.Random, s: SoakSettings) -> tuple[str, dict]:
    sampling = dict(max_tokens=rng.randint(1, s.max_tokens), temperature=rng.choice([0.0, 0.8]),
                    seed=rng.randrange(2**31), ignore_eos=rng.random() < 0.5)
    if kind == "chat":
        return "/v1/chat/completions", dict(messages=[{"role": "user", "content": rng.choice(PROMPTS)}], **sampling)
    return "/v1/completions", dict(prompt=rng.choice(PROMPTS), **sampling)


async def streamed(http, url: str, path: str, body: dict, leave_after: int | None) -> str:
    lines = []
    async with http.stream("POST", url + path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return f"status {r.status_code}: {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if leave_after is not None and len(lines) > leave_after:
                    return "left"  # closing the response drops the connection under the server
    if not lines or lines[-1] != "data: [DONE]":
        return f"the stream ended without [DONE]: {lines[-1:]!r}"
    bad = [line for line in lines[:-1] if "error" in json.loads(line[6:])]
    return f"error chunk: {bad[0][:200]}" if bad else "ok"


async def full(http, url: str, path: str, body: dict, give_up_s: float | None) -> str:
    try:
        r = await asyncio.wait_for(http.post(url + path, json=body), give_up_s)
    except TimeoutError:
        return "left"  # cancelling the request closes its connection
    if r.status_code != 200:
        return f"status {r.status_code}: {r.text[:200]}"
    choice = r.json()["choices"][0]
    return "ok" if choice["finish_reason"] in ("stop", "length") else f"finish_reason {choice['finish_reason']}"


async def bad(http, url: str, rng: random.Random) -> str:
    path, body, status = rng.choice(BAD)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = await http.post(url + path, content=content, headers={"Content-Type": "application/json"})
    if r.status_code != status:
        return f"{path} {content[:60]!r}: status {r.status_code}, expected {status}: {r.text[:200]}"
    err = r.json().get("error", {})
    return "ok" if set(err) == {"message", "type", "param", "code"} else f"not an OpenAI error body: {r.text[:200]}"


async def one(kind: str, http, url: str, rng: random.Random, s: SoakSettings) -> str:
    path, body = body_for(kind, rng, s)
    if kind in ("stream", "chat", "stream-leave"):
        return await streamed(http, url, path, body, rng.randint(1, 4) if kind == "stream-leave" else None)
    if kind in ("full", "full-leave"):
        return await full(http, url, path, body, rng.uniform(0.02, 0.5) if kind == "full-leave" else None)
    return await bad(http, url, rng)


async def client(c: int, http, url: str, s: SoakSettings, deadline: float, tally: Tally) -> None:
    rng = random.Random(s.seed * 100_003 + c)
    i = c
    while time.monotonic() < deadline:
        kind = KINDS[i % len(KINDS)]
        i += 1
        try:
            outcome = await one(kind, http, url, rng, s)
        except Exception as exc:  # transport failures and broken bodies are errors too
            outcome = f"{type(exc).__name__}: {exc}"
        tally.record(kind, outcome)


# ---- the server process and what is sampled from it ------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(s: SoakSettings, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dspark", "serve", "--port", str(port), "--num-kv-blocks", str(s.num_kv_blocks),
           "--log-level", "warning", "--seed", str(s.seed)]
    for flag, value in (("--model", s.model), ("--device", s.device), ("--drafter", s.drafter),
                        ("--policy", s.policy)):
        if value:
            cmd += [flag, value]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def metrics(url: str) -> dict[str, float]:
    """Every unlabelled sample and every labelled one summed over its labels."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0.0) + value
            if "{" in line:
                out[line.rsplit(" ", 1)[0]] = value
    return out


def sample(url: str, pid: int, t: float) -> dict:
    import psutil

    m = metrics(url)
    return {"t_s": round(t, 1), "rss_mib": round(psutil.Process(pid).memory_info().rss / 2**20, 1),
            **{g.removeprefix("dspark_"): int(m.get(g, 0)) for g in GAUGES}}


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError("the server exited during start-up")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start in {timeout_s:.0f} s")
        time.sleep(0.5)


def wait_idle(url: str, timeout_s: float = 120.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no block is used (or time runs out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(url)
        busy = m.get("dspark_requests_running", 0) + m.get("dspark_requests_waiting", 0)
        if (busy == 0 and m.get("dspark_kv_blocks_used", 0) == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


async def load(url: str, pid: int, s: SoakSettings, tally: Tally, start: float) -> list[dict]:
    import httpx

    deadline, samples = start + s.duration_s, []
    limits = httpx.Limits(max_connections=4 * s.clients, max_keepalive_connections=2 * s.clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as http:
        clients = asyncio.gather(*(client(c, http, url, s, deadline, tally) for c in range(s.clients)))
        while not clients.done():
            samples.append(await asyncio.to_thread(sample, url, pid, time.monotonic() - start))
            await asyncio.wait([clients], timeout=s.sample_every_s)
        await clients
    return samples


def run(s: SoakSettings, out_dir: str | Path) -> dict:
    """Run the soak and write soak.json / soak.md to out_dir; -> the report."""
    from dspark import report

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = start_server(s, port, log)
        try:
            wait_healthy(url, proc, s.startup_timeout_s)
            tally, start = Tally(), time.monotonic()
            samples = asyncio.run(load(url, proc.pid, s, tally, start))
            final_metrics = wait_idle(url)
            samples.append({**sample(url, proc.pid, time.monotonic() - start), "after_load": True})
            alive = proc.poll() is None
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.seek(0)
            server_log = log.read().decode(errors="replace")[-4000:]
    data = summarize(s, tally, samples, final_metrics, alive, server_log)
    report.write(out_dir, "soak", data, markdown(data))
    return data


def summarize(s: SoakSettings, tally: Tally, samples: list[dict], m: dict, alive: bool, server_log: str) -> dict:
    during = [x for x in samples if not x.get("after_load")]
    warm = [x for x in during if x["t_s"] >= 0.1 * s.duration_s] or during
    rss = [x["rss_mib"] for x in warm]
    finished = {k.split('"')[1]: int(v) for k, v in m.items() if k.startswith("dspark_requests_finished_total{")}
    return {
        "settings": asdict(s), "requests": tally.counts, "errors": tally.errors, "problems": tally.problems,
        "server": {"alive_after_load": alive, "finished_by_reason": finished,
                   "preemptions": int(m.get("dspark_preemptions_total", 0)),
                   "step_errors": int(m.get("dspark_engine_step_errors_total", 0)),
                   "kv_blocks_used_after_load": samples[-1]["kv_blocks_used"] if samples else None,
                   "log_tail": server_log if tally.errors or not alive else ""},
        "rss_mib": {"after_warmup": rss[0] if rss else None, "end": rss[-1] if rss else None,
                    "max": max(rss, default=None), "min": min(rss, default=None)},
        "kv_blocks_used": {"max": max((x["kv_blocks_used"] for x in during), default=None),
                           "mean": round(sum(x["kv_blocks_used"] for x in during) / max(len(during), 1), 2)},
        "samples": samples,
    }


def markdown(d: dict) -> str:
    from dspark.report import table

    s, r, k, srv = d["settings"], d["rss_mib"], d["kv_blocks_used"], d["server"]
    head = (f"# Soak: {s['duration_s']:.0f} s, {s['clients']} clients, {s['num_kv_blocks']} KV blocks\n\n"
            f"**{d['errors']} errors** besides the deliberate faults (clients leaving, bad bodies); "
            f"{srv['preemptions']} preemptions; {srv['step_errors']} engine step errors; KV blocks in use "
            f"after the load: {srv['kv_blocks_used_after_load']}.\n\n"
            f"Server RSS (MiB) after warm-up {r['after_warmup']}, at the end {r['end']}, range "
            f"{r['min']}..{r['max']}; KV blocks in use: max {k['max']}, mean {k['mean']}.\n\n")
    kinds = table(["kind", "sent", "ok", "left", "errors"],
                  [[kind, *row.values()] for kind, row in d["requests"].items()])
    samples = d["samples"]
    shown = [x for i, x in enumerate(samples) if i % max(1, len(samples) // 40) == 0 or i >= len(samples) - 2]
    rows = [[x["t_s"], x["rss_mib"], x["kv_blocks_used"], x["requests_running"], x["requests_waiting"],
             "after the load" if x.get("after_load") else ""] for x in shown]
    over_time = table(["t (s)", "RSS (MiB)", "KV blocks used", "running", "waiting", ""], rows)
    problems = "".join(f"- `{p}`\n" for p in d["problems"])
    return head + kinds + "\n## Over time\n\n" + over_time + ("\n## Errors\n\n" + problems if problems else "")

"""`dspark calibrate --drafter PATH`: fit STS temperatures on held-out rollouts.

Rollouts are real verification rounds: the drafter proposes, the full block is verified
(`static:gamma`), and each round records the raw confidence logits and how many draft
tokens were accepted. STS (`spec/sts.py`) is fitted on the rounds of every other prompt
and scored on the rounds of the remaining prompts (so the reported ECE is out of sample); the temperatures are
written into the drafter's config.json: `sts_temperatures` from sampled rollouts, `sts_greedy` from
greedy ones (`--temperature 0`: a greedy draft token survives when it is the target's argmax, which
the same head predicts differently well); ECE/AUROC/Brier per position before and after and
a reliability diagram go to the output directory.

    dspark calibrate --drafter dspark-tiny/drafters/dspark --prompts heldout.jsonl --out docs/results/calibration
    dspark calibrate --drafter dspark-tiny/drafters/dspark --temperature 0 --out docs/results/calibration-greedy
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark import report
from dspark.config import EngineConfig
from dspark.engine.engine import LLMEngine
from dspark.engine.factory import build_engine
from dspark.engine.speculative import SpeculativeRunner
from dspark.sampling import SamplingParams
from dspark.spec.sts import Calibration, fit_sts, metrics, outcomes, survival


def rollout_engine(model: str | None, drafter: str) -> LLMEngine:
    """An engine that verifies every drafted position (static:64 is capped at the drafter's gamma)."""
    return build_engine(model, drafter, "static:64", EngineConfig(max_num_seqs=16), profile="off")


def collect(engine: LLMEngine, prompts: list[str], max_tokens: int, temperature: float,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """-> conf logits [N, g] and accepted [N] over all full-block rounds of these prompts."""
    runner = engine.runner
    if not isinstance(runner, SpeculativeRunner):
        raise ValueError("calibration rollouts need a speculative engine (a drafter and a policy)")
    runner.recorder = []
    gamma = runner.gamma
    reqs = [engine.add_request(p, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i))
            for i, p in enumerate(prompts)]
    engine.run_until_done(reqs)
    logits, accepted = [], []
    for conf, lengths, acc in runner.recorder:
        for i, ell in enumerate(lengths):
            if ell == gamma:  # full block verified: every outcome y_k observed
                logits.append(conf[i])
                accepted.append(acc[i])
    if not logits:
        raise ValueError("no full-block rounds were recorded; is this a drafter with a confidence head?")
    return torch.stack(logits), torch.tensor(accepted)


def reliability_plot(logits: torch.Tensor, accepted: torch.Tensor, cal: Calibration, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = logits.shape[1]
    outcome = (accepted[:, None] >= torch.arange(1, g + 1)[None]).float()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharey=True)
    for ax, temps, title in ((axes[0], [1.0] * g, "raw"), (axes[1], cal.temperatures, "after STS")):
        pred = survival(logits.double(), temps)
        for k in range(g):
            idx = (pred[:, k].clamp(0, 1 - 1e-9) * 10).long()
            xs, ys = [], []
            for b in range(10):
                sel = idx == b
                if int(sel.sum()) >= 5:
                    xs.append(float(pred[sel, k].mean()))
                    ys.append(float(outcome[sel, k].mean()))
            ax.plot(xs, ys, marker="o", label=f"k={k + 1}")
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax.set_title(f"Prefix survival a_k: {title}")
        ax.set_xlabel("predicted P(prefix accepted through k)")
    axes[0].set_ylabel("observed rate")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def shipped_temperatures(cal: Calibration, current: tuple[list[float], list[dict]] | None = None
                         ) -> tuple[list[float] | None, str]:
    """The temperatures to write: of the fitted ones, 1.0 everywhere (raw) and `current` (the ones
    these requests read now, with their held-out metrics), those with the lowest mean held-out ECE
    (a per-position grid fit can chase noise at deep positions, where few blocks survive). None:
    `current` wins, keep the config as it is. Returns them and a sentence for the report."""
    def mean(rows: list[dict]) -> float:
        return sum(r["ece"] for r in rows) / len(rows)

    raw, fitted = mean(cal.before), mean(cal.after)
    now = mean(current[1]) if current else float("inf")
    if now < min(raw, fitted):
        return None, (f"Kept: the temperatures these requests read now, {[round(t, 3) for t in current[0]]}, score "
                      f"best (mean held-out ECE {now:.4f}; fitted {fitted:.4f}, raw {raw:.4f}).")
    if fitted < raw:
        return list(cal.temperatures), f"Written: the fitted temperatures (mean held-out ECE {raw:.4f} -> {fitted:.4f})."
    return [1.0] * len(cal.temperatures), (f"Written: 1.0 at every position, the raw confidences: STS did not lower "
                                           f"the mean held-out ECE ({raw:.4f} -> {fitted:.4f}).")


def current_temperatures(raw: dict, key: str) -> list[float]:
    """What requests of this kind read now, from a drafter's config.json: `sts_greedy` falls back to
    `sts_temperatures` ([]: raw)."""
    return list(raw.get(key) or raw.get("sts_temperatures") or [])


def config_key(temperature: float) -> str:
    """Where temperatures fitted at this sampling temperature go: greedy requests read `sts_greedy`,
    the others `sts_temperatures`."""
    return "sts_greedy" if temperature == 0 else "sts_temperatures"


def calibrate(model: str | None, drafter_dir: str, prompts: list[str], out_dir: str, max_tokens: int = 128,
              temperature: float = 1.0, write: bool = True) -> Calibration:
    if len(prompts) < 2:
        raise ValueError("calibration needs at least 2 prompts (half to fit, half to report on)")
    if not (Path(drafter_dir) / "config.json").is_file():  # before the rollouts, which take minutes
        raise ValueError(f"{drafter_dir!r} is not a drafter directory (config.json): calibration reads and writes the "
                         "temperatures of one drafter's checkpoint")
    engine = rollout_engine(model, drafter_dir)
    logits, accepted = collect(engine, prompts[::2], max_tokens, temperature)
    held = collect(engine, prompts[1::2], max_tokens, temperature, seed=len(prompts))
    cal = fit_sts(logits, accepted, held)
    logits, accepted = held
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reliability_plot(logits, accepted, cal, out / "reliability.png")
    key = config_key(temperature)
    cfg_path = Path(drafter_dir) / "config.json"
    raw = json.loads(cfg_path.read_text())
    now = current_temperatures(raw, key)
    fits = len(now) == logits.shape[1]  # temperatures for another gamma say nothing about this one
    current = (now, metrics(survival(logits.double(), now), outcomes(accepted, len(now)))) if fits else None
    temps, verdict = shipped_temperatures(cal, current)
    if write and temps is not None:
        raw[key] = [round(t, 5) for t in temps]
        cfg_path.write_text(json.dumps(raw, indent=2))
    elif temps is not None:  # --no-write: say what would have been written, write nothing
        verdict, temps = f"Not written (--no-write); the choice: {verdict}", None
    rows = [[k + 1, b["ece"], a["ece"], b["auroc"] or float("nan"), a["auroc"] or float("nan"), b["brier"], a["brier"],
             a["observed"]] for k, (b, a) in enumerate(zip(cal.before, cal.after, strict=True))]
    md = (f"# STS calibration of `{drafter_dir}`\n\nTemperatures fitted on the full-block rounds of half the prompts; "
          f"the metrics below are on the other half ({len(accepted)} rounds), at temperature {temperature}.\n\n"
          + report.table(["k", "ECE raw", "ECE STS", "AUROC raw", "AUROC STS", "Brier raw", "Brier STS", "observed a_k"], rows)
          + f"\nFitted temperatures: {[round(t, 3) for t in cal.temperatures]}. {verdict} (config key `{key}`)\n\n"
          "![reliability](reliability.png)\n")
    report.write(out, "calibration", {"drafter": drafter_dir, "rounds": len(accepted), "temperature": temperature, "key": key,
                                       "temperatures": cal.temperatures, "written": temps, "before": cal.before, "after": cal.after,
                                       "current": current[1] if current else None}, md)
    print(md)
    return cal

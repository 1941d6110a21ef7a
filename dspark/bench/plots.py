"""PNG figures of the benchmarks (matplotlib, Agg backend: no display needed).

- `acceptance_curves`: conditional acceptance per draft position, one line per drafter,
  one panel per domain (Fig. 2 analog);
- `threshold_sweep`: per threshold, accepted and rejected draft tokens verified per round
  (stacked bars), acceptance rate and tau (lines), one panel per domain (Fig. 5 analog);
- `frontier`: aggregate throughput against per-user speed, one curve per configuration,
  points labelled with their concurrency (Fig. 7 analog);
- `budget`: aggregate throughput and verification budget against concurrency (Fig. 8);
- `gate_timeline`: a traced run's never-slower gate step by step, one panel per gated configuration and
  concurrency: the depth it drafted at (0: closed), its probes, and everyone's first-position acceptance.

Called by offline.py / online.py; every function takes plain rows and a path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(plt, n: int, height: float = 3.2):
    fig, axes = plt.subplots(1, max(1, n), figsize=(4.2 * max(1, n), height), squeeze=False)
    return fig, list(axes[0])


def _save(fig, path: str | Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return Path(path)


def acceptance_curves(curves: dict[str, dict[str, Sequence[float | None]]], path: str | Path) -> Path:
    """curves[domain][drafter] = conditional acceptance at positions 1.."""
    plt = _plt()
    fig, axes = _panels(plt, len(curves))
    for ax, (domain, by_drafter) in zip(axes, curves.items(), strict=False):
        for drafter, ys in by_drafter.items():
            pts = [(k + 1, y) for k, y in enumerate(ys) if y is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=drafter)
        ax.set(title=domain, xlabel="draft position", ylabel="conditional acceptance", ylim=(0, 1.02),
               xticks=range(1, 1 + max((len(ys) for ys in by_drafter.values()), default=1)))
        ax.grid(alpha=0.3)
        _legend(ax)
    return _save(fig, path)


def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, **kw)


def threshold_sweep(rows: dict[str, Sequence[dict]], path: str | Path) -> Path:
    """rows[domain] = [{threshold, accepted_per_round, verified_per_round, acceptance_rate, tau}]."""
    plt = _plt()
    fig, axes = _panels(plt, len(rows), 3.6)
    for ax, (domain, pts) in zip(axes, rows.items(), strict=False):
        pts = sorted(pts, key=lambda r: r["threshold"])
        xs = [f"{r['threshold']:.1f}" for r in pts]
        acc = [r["accepted_per_round"] or 0.0 for r in pts]
        rej = [(r["verified_per_round"] or 0.0) - a for r, a in zip(pts, acc, strict=True)]
        ax.bar(xs, acc, label="accepted", color="tab:green")
        ax.bar(xs, rej, bottom=acc, label="rejected", color="tab:red", hatch="//", alpha=0.6)
        ax.plot(xs, [r["tau"] or 0.0 for r in pts], "k^-", label="tau")
        ax.set(title=domain, xlabel="confidence threshold", ylabel="draft tokens verified per round / tau")
        rate = ax.twinx()
        rate.plot(xs, [r["acceptance_rate"] or 0.0 for r in pts], "bo-", label="acceptance rate")
        rate.set(ylim=(0, 1.05), ylabel="acceptance rate")
        ax.legend(loc="upper left", fontsize=7)
        rate.legend(loc="upper right", fontsize=7)
    return _save(fig, path)


def _by_config(rows: Sequence[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["concurrency"]):
        out.setdefault(r["config"], []).append(r)
    return out


def frontier(rows: Sequence[dict], path: str | Path, title: str = "") -> Path:
    plt = _plt()
    fig, (ax,) = _panels(plt, 1, 4.0)
    fig.set_size_inches(6.0, 4.2)
    for config, pts in _by_config(rows).items():
        pts = [r for r in pts if r.get("per_user_tok_s_mean") and r.get("throughput_tok_s")]
        if not pts:
            continue
        xs, ys = [r["per_user_tok_s_mean"] for r in pts], [r["throughput_tok_s"] for r in pts]
        ax.plot(xs, ys, marker="o", label=config)
        for r, x, y in zip(pts, xs, ys, strict=True):
            ax.annotate(str(r["concurrency"]), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="per-user tok/s (mean)", ylabel="aggregate output tok/s", title=title or "throughput vs interactivity")
    ax.grid(alpha=0.3)
    _legend(ax)
    return _save(fig, path)


def budget(rows: Sequence[dict], path: str | Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(2, 1, figsize=(6.0, 6.0), sharex=True)
    for config, pts in _by_config(rows).items():
        cs = [r["concurrency"] for r in pts]
        axes[0].plot(cs, [r.get("throughput_tok_s") or 0.0 for r in pts], marker="o", label=config)
        axes[1].plot(cs, [r.get("budget") or 0.0 for r in pts], marker="o", label=config)
    axes[0].set(ylabel="aggregate output tok/s")
    axes[1].set(ylabel="draft tokens verified\nper request per round", xlabel="concurrent requests")
    ticks = sorted({r["concurrency"] for r in rows})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.grid(alpha=0.3)
    _legend(axes[0])
    return _save(fig, path)


def gate_timeline(runs: dict[tuple[str, int], list[dict]], path: str | Path) -> Path | None:
    """The gate's states per (config, concurrency) of a traced run (`steptrace.gate_runs`): one panel per gated
    configuration (rows) and concurrency (columns), the verdict's depth by step (0 while closed) as a step line,
    probes as marks, and the first position's acceptance estimate on a second axis. None (and no file) when no
    configuration was gated."""
    if not runs:
        return None
    configs = list(dict.fromkeys(k[0] for k in runs))
    levels = sorted({k[1] for k in runs})
    plt = _plt()
    fig, axes = plt.subplots(len(configs), len(levels), figsize=(4.2 * len(levels), 3.0 * len(configs)), squeeze=False)
    for (config, c), gates in runs.items():
        ax = axes[configs.index(config)][levels.index(c)]
        steps = range(len(gates))
        ax.step(steps, [g["depth"] for g in gates], where="post", label="depth (0: closed)")
        probes = [i for i, g in enumerate(gates) if g["probe"]]
        ax.plot(probes, [0] * len(probes), "v", color="tab:red", label="probe")
        ax.set(xlabel="step", ylabel="draft depth", title=f"{config}, C = {c}",
               ylim=(-0.3, max(g["depth"] for g in gates) + 0.5))  # 0 (closed) in view even where never reached
        twin = ax.twinx()
        twin.plot(steps, [g["acceptance"][0] for g in gates], color="tab:green", label="first-position acceptance")
        twin.set(ylim=(0, 1), ylabel="acceptance estimate")
        _legend(ax, loc="upper left")
        _legend(twin, loc="lower right")
    for row in axes:  # a configuration with no gated steps at some concurrency leaves its panel empty
        for ax in row:
            if not ax.has_data():
                ax.set_axis_off()
    return _save(fig, path)

"""PNG figures (matplotlib, Agg backend): reliability diagrams, SPS curves, threshold sweeps,
load-adaptive verification budgets."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dspec_cli.core.hardware import CostTable  # noqa: E402
from dspec_cli.core.outputs import write_atomic  # noqa: E402

FEW_ROUNDS = 30  # a point resting on fewer rounds is drawn hollow and labelled with its count


def _save(fig, path: str | Path) -> Path:
    """Write the PNG atomically (:func:`~dspec_cli.core.outputs.write_atomic`) and close the figure."""
    path = Path(path)
    try:
        write_atomic(path, lambda p: fig.savefig(p, dpi=120, bbox_inches="tight", format="png"))
    finally:
        plt.close(fig)
    return path


def report_title(report: dict) -> str:
    """"target · device (type, dtype) · temperature T" of a bench report."""
    env = report.get("env", {})
    temps = sorted({r["temperature"] for r in report.get("runs", []) if "temperature" in r})
    temp = "temperature " + ", ".join(f"{t:g}" for t in temps) if temps else ""
    where = f"{env.get('device_name', '')} ({env.get('device', '')}, {env.get('dtype', '')})" if env else ""
    return " · ".join(x for x in (report.get("target", ""), where, temp) if x)


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion (sensible for small n and for 0 or n successes)."""
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def _legend_below(ax, ncol: int = 2) -> None:
    """The legend under the axes, never over the data."""
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=ncol, frameon=False)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def reliability_diagram(
    before: Sequence[dict], after: Sequence[dict] | None, path: str | Path, title: str = ""
) -> Path:
    """One panel per position from :func:`dspec_cli.workflows.calibrate.reliability` data (before and after STS).

    Lines: observed acceptance against mean predicted survival per non-empty bin; the
    diagonal is perfect calibration; grey bars (right axis) are the sample counts per bin.
    """
    n = len(before)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for i, pos in enumerate(before):
        ax = axes.flat[i]
        edges = pos["edges"]
        hist = ax.twinx()
        hist.bar(edges[:-1], pos["count"], width=edges[1] - edges[0], align="edge", color="0.85", zorder=0)
        hist.set_yticks([])
        ax.set_zorder(hist.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect")
        series = [("before", pos, "tab:red")] + ([("after", after[i], "tab:blue")] if after else [])
        text = []
        for label, data, color in series:
            pts = [(p, y) for p, y in zip(data["mean_pred"], data["mean_label"], strict=True) if p is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", ms=3, color=color, label=label)
            text.append(f"ECE {label} {_pct(data['ece'])}")
        auc = pos["auroc"]
        text.append(f"AUC {'-' if auc is None else f'{auc:.3f}'}")
        ax.text(0.03, 0.97, "\n".join(text), transform=ax.transAxes, va="top", fontsize=7,
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1})
        ax.set(xlim=(0, 1), ylim=(0, 1), title=f"position {pos['position']}")
        ax.set_xticks([0, 0.5, 1], ["0", "0.5", "1"])
        ax.set_yticks([0, 0.5, 1], ["0", "0.5", "1"])
        if i % cols == 0:
            ax.set_ylabel("observed acceptance")
        if i >= n - cols:
            ax.set_xlabel("predicted survival")
    axes.flat[0].legend(loc="lower right", fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def sps_plot(table: CostTable, path: str | Path) -> Path:
    """Measured SPS(B) (markers with IQR bars) and the cleaned monotone curve, one colour per context."""
    import torch

    fig, ax = plt.subplots(figsize=(6.5, 4))
    b = torch.arange(1, table.grid[-1] + 1, dtype=torch.float64)
    for ctx in table.contexts:
        raw = table.measured[str(ctx)]
        err = table.spread.get(str(ctx))
        line = ax.errorbar(table.grid, raw, yerr=[e / 2 for e in err] if err else None, fmt="o", ms=3,
                           capsize=2, label=f"context {ctx}")
        ax.plot(b, 1.0 / table.step_time(b, ctx), "-", lw=1, color=line[0].get_color())
    ax.set(xlabel="tokens per forward B", ylabel="steps per second SPS(B)",
           title=f"{table.model} · {table.device_name} · {table.dtype}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    return _save(fig, path)


def threshold_sweep_plot(sweep: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """The paper's Fig. 5: accepted and rejected tokens per step (bars), acceptance rate (line)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    t = [row["threshold"] for row in sweep]
    acc = [row["accepted_per_step"] for row in sweep]
    rej = [row["rejected_per_step"] for row in sweep]
    width = 0.8 * (t[1] - t[0]) if len(t) > 1 else 0.08
    ax.bar(t, acc, width=width, color="tab:blue", label="accepted tokens")
    ax.bar(t, rej, width=width, bottom=acc, color="white", edgecolor="tab:blue", hatch="//", label="rejected tokens")
    ax.set(xlabel="confidence threshold", ylabel="avg. tokens per step")
    rate = ax.twinx()
    rate.plot(t, [100 * (r["acceptance_rate"] or 0) for r in sweep], "o-", color="tab:red", label="acceptance rate")
    rate.set(ylabel="acceptance rate (%)", ylim=(0, 105))
    handles = ax.get_legend_handles_labels()[0] + rate.get_legend_handles_labels()[0]
    ax.legend(handles, [str(h.get_label()) for h in handles], fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15),
              ncol=3, frameon=False)
    if title:
        ax.set_title(title)
    return _save(fig, path)


def schedule_plot(results: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Throughput (top) and verification budget per request (bottom) against concurrency, per scheduler."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    for name in dict.fromkeys(r["scheduler"] for r in results):
        rows = [r for r in results if r["scheduler"] == name]
        x = [r["concurrency"] for r in rows]
        top.plot(x, [r["tokens_per_s"] for r in rows], "o-", label=name)
        bottom.plot(x, [r["budget"] for r in rows], "o-", label=name)
    plain = sorted({(r["concurrency"], r["plain_tokens_per_s"]) for r in results})
    top.plot(*zip(*plain, strict=True), "k--", lw=1, label="plain decoding")
    top.set(ylabel="tokens / s (τ·SPS(B))")
    bottom.set(xlabel="concurrent requests", ylabel="verification budget (ℓ + 1)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["concurrency"] for r in results}), [str(c) for c in sorted({r["concurrency"] for r in results})])
    top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    if title:
        top.set_title(title, fontsize=9)
    return _save(fig, path)


def _run_label(run: dict) -> str:
    sched = run.get("scheduler", "fixed")
    return run["drafter"] if sched in ("-", "fixed") else f"{run['drafter']} · {sched}"


def acceptance_plot(runs: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """The paper's Fig. 2: conditional acceptance by draft position, one panel per dataset,
    one line per drafter (runs at the lowest concurrency). Bars: 95 % Wilson intervals; a point
    resting on fewer than ``FEW_ROUNDS`` rounds is hollow and labelled n=count."""
    datasets = list(dict.fromkeys(r["dataset"] for r in runs))
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.6 * len(datasets), 4.2), squeeze=False, sharey=True)
    for ax, dset in zip(axes.flat, datasets, strict=False):
        rows = [r for r in runs if r["dataset"] == dset]
        low = min(r.get("concurrency", 1) for r in rows)
        shown = [r for r in rows if r.get("concurrency", 1) == low]
        for i, run in enumerate(shown):
            dx = (i - (len(shown) - 1) / 2) * 0.12  # side by side: intervals and labels of runs do not overlap
            counts = run.get("cond_accept_rounds") or [None] * len(run["cond_accept"])
            pts = [(k + 1 + dx, a, n) for k, (a, n) in enumerate(zip(run["cond_accept"], counts, strict=False)) if a is not None]
            if not pts:
                continue
            line = ax.plot([x for x, _, _ in pts], [100 * a for _, a, _ in pts], "-", lw=1.2,
                           label=f"{_run_label(run)} (τ {run['tau']:.2f})")[0]
            color = line.get_color()
            for x, a, n in pts:
                few = n is not None and n < FEW_ROUNDS
                ax.plot(x, 100 * a, "o", ms=4, color=color, mfc="white" if few else color, zorder=3)
                if n:
                    lo, hi = wilson(round(a * n), n)
                    ax.plot([x, x], [100 * lo, 100 * hi], "-", lw=0.8, color=color, alpha=0.5)
                if few:
                    ax.annotate(f"n={n}", (x, 100 * a), textcoords="offset points", xytext=(3, 6 if i % 2 else -10),
                                fontsize=6, color=color)
        ax.set(title=dset, xlabel="draft position k", ylim=(0, 105))
        ax.set_xticks(range(1, max(len(r["cond_accept"]) for r in rows) + 1))
        ax.grid(alpha=0.3)
        _legend_below(ax, ncol=1)
    axes.flat[0].set_ylabel("P(accept k | accepted 1..k-1) (%)")
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def load_plots(runs: Sequence[dict], out_dir: str | Path, title: str = "") -> list[Path]:
    """Serving under load, per dataset (``load.png``, or ``load-<i>.png`` in dataset order):
    aggregate against per-user throughput (the paper's Fig. 7; plain decoding dashed; each point
    labelled with its concurrency R) and mean verification budget against concurrency (Fig. 8)."""
    out_dir, paths = Path(out_dir), []
    datasets = list(dict.fromkeys(r["dataset"] for r in runs))
    for i, dset in enumerate(datasets):
        rows = [r for r in runs if r["dataset"] == dset]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
        for label in dict.fromkeys(_run_label(r) for r in rows):
            series = sorted((r for r in rows if _run_label(r) == label), key=lambda r: r["concurrency"])
            xs, ys = [r["per_user_tokens_per_s"] for r in series], [r["throughput_tokens_per_s"] for r in series]
            line = left.plot(xs, ys, "o-", label=label)[0]
            for r, x, y in zip(series, xs, ys, strict=True):
                left.annotate(f"R={r['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=6,
                              color=line.get_color())
            right.plot([r["concurrency"] for r in series], [r["mean_verify_budget"] for r in series], "o-", label=label)
        plain = sorted({(r["concurrency"], r["baseline_tokens_per_s"]) for r in rows if r.get("baseline_tokens_per_s")})
        if plain:
            left.plot([tps / c for c, tps in plain], [tps for _, tps in plain], "k--", lw=1, label="plain decoding")
        left.set(xlabel="per-user tokens / s", ylabel="aggregate tokens / s", title=f"{dset}: throughput")
        right.set(xlabel="concurrent requests R", ylabel="mean verification budget\n(tokens / request / round)",
                  title=f"{dset}: budget")
        right.set_xscale("log", base=2)
        levels = sorted({r["concurrency"] for r in rows})
        right.set_xticks(levels, [str(c) for c in levels])
        for ax in (left, right):
            ax.grid(alpha=0.3)
            _legend_below(ax)
        if title:
            fig.suptitle(title, fontsize=9)
        paths.append(_save(fig, out_dir / ("load.png" if len(datasets) == 1 else f"load-{i + 1}.png")))
    return paths

"""Render `dspec bench --json` reports as the markdown tables of docs/benchmarks.md.

    python -m benchmarks.table REPORT.json [REPORT.json ...] [--load]

Default columns: dataset, drafter, τ, tokens/s, baseline, speedup, target tokens verified per
committed token, conditional acceptance by position, draft time share. ``--load`` switches to
the serving columns (scheduler, concurrency, aggregate and per-user tokens/s, budget, share of
rounds that drafted, over all repeats).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspec_cli.workflows.bench import drafted_share, format_speedup


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _pct(share) -> str:
    """A share as a percentage ("-" when the report predates the field)."""
    return "-" if share is None else f"{100 * share:.0f}%"


def drafter_table(runs: list[dict]) -> str:
    head = ("| dataset | drafter | τ | tokens/s | baseline tokens/s | speedup | verified per committed "
            "| cond. acceptance k=1..γ | draft time |\n|---|---|---|---|---|---|---|---|---|")
    rows = [
        f"| {r['dataset']} | {r['drafter']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
        f"{_f(r['baseline_tokens_per_s'], '.1f')} | {format_speedup(r)} | {r['verified_per_committed']:.2f} | "
        f"{' '.join(_f(a, '.2f') for a in r['cond_accept'])} | {100 * r['draft_time_share']:.0f}% |"
        for r in runs
    ]
    return "\n".join([head, *rows])


def load_table(runs: list[dict]) -> str:
    head = ("| dataset | drafter | scheduler | R | τ | aggregate tokens/s | plain tokens/s | vs plain "
            "| per-user tokens/s | mean budget | rounds drafted |\n|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [
        f"| {r['dataset']} | {r['drafter']} | {r['scheduler']} | {r['concurrency']} | {r['tau']:.2f} | "
        f"{r['throughput_tokens_per_s']:.1f} | {_f(r['baseline_tokens_per_s'], '.1f')} | {format_speedup(r)} | "
        f"{r['per_user_tokens_per_s']:.1f} | {r['mean_verify_budget']:.2f} | {_pct(drafted_share(r))} |"
        for r in runs
    ]
    return "\n".join([head, *rows])


def macro_tau(runs: list[dict]) -> dict[str, float]:
    """Mean τ over datasets per drafter label (the paper's macro-average)."""
    by: dict[str, list[float]] = {}
    for r in runs:
        by.setdefault(r["drafter"], []).append(r["tau"])
    return {k: sum(v) / len(v) for k, v in by.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("reports", nargs="+", type=Path)
    p.add_argument("--load", action="store_true", help="serving-under-load columns")
    args = p.parse_args(argv)
    runs = [r for path in args.reports for r in json.loads(path.read_text())["runs"]]
    print(load_table(runs) if args.load else drafter_table(runs))
    if not args.load:
        print("\nmacro-average τ: " + ", ".join(f"{k} {v:.2f}" for k, v in macro_tau(runs).items()))


if __name__ == "__main__":
    main()

"""What batch-invariant verification costs: dspec's engine with its invariant attention against the
same engine with PyTorch's fused attention (``GenerationConfig.batch_invariant`` on and off), on the
same prompts, the same target and the same CPU, in one process.

    python -m benchmarks.batch_invariance --dataset gsm8k.jsonl --dataset humaneval.jsonl \
        --dataset mt-bench.jsonl --skip 60 --num-prompts 4 --max-new-tokens 128 --temperature 0,1 \
        --concurrency 1,8 --drafter dspark-markov --graphs eager --repeats 4 --json batch-invariance.json

The embedded target runs in bfloat16 (dspec's own forward on a CPU: the only forward with both
attentions). Every request generates exactly ``--max-new-tokens`` tokens (no stop tokens); at R = 1
requests run one at a time, at R > 1 all prompts are queued and served R at a time. Engines run
plain decoding and each ``--drafter`` (default dspark-markov), each with the setting on and off.
Repeats are interleaved: in every repeat and (T, R, drafter) cell the invariant and the fused
engine run one after the other, which one first alternating by repeat, with a pause before each
timed run, so machine drift hits both alike. Per cell the JSON gives each setting's median tokens/s
and the median of the paired ratios fused / invariant with their min and max (above 1: what the
invariance costs), and at T = 0 how many of each drafter's outputs equal plain decoding's under the
same setting, token for token. ``other_cores``: the CPU other processes took during a timed run
(above ~0.1 the run was disturbed). The table (CPU named) goes to stdout and next to the JSON as
``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.vs_vllm import cpu_description, held_out_prompts, workload_options
from dspec_cli.checkpoints.loading import load_drafter
from dspec_cli.core.cpu_load import busy_seconds
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.target import Target

PLAIN = "plain"
SETTLE_S = 1.0  # pause before each timed run
SETTINGS = (True, False)  # batch_invariant: the invariant attention, then the fused one


def _run(engine: SpeculativeEngine, prompts: list[list[int]]) -> dict:
    """One timed run: tokens/s, τ, outputs and the CPU other processes took meanwhile."""
    own0, busy0, t0 = _own_seconds(), busy_seconds(), time.perf_counter()
    results = engine.generate(prompts)
    wall = time.perf_counter() - t0
    own1, busy1 = _own_seconds(), busy_seconds()
    tokens = sum(len(r.output_ids) for r in results)
    rounds = sum(len(r.accepted) for r in results)
    out = {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
           "tau": (sum(sum(r.accepted) for r in results) + rounds) / rounds if engine.drafter is not None else None,
           "token_ids": [r.output_ids for r in results]}
    if busy0 is not None and busy1 is not None:
        out["other_cores"] = round(max((busy1 - busy0) - (own1 - own0), 0.0) / wall, 3)
    return out


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _summary(runs: list[dict], names: list[str], temps: list[float], rows_list: list[int]) -> list[dict]:
    """Per (T, R, drafter): each setting's median tokens/s and τ, the paired ratios fused /
    invariant (median, min, max) and, at T = 0, greedy identity with plain decoding per setting."""
    out = []
    for temp in temps:
        for rows in rows_list:
            cell = [r for r in runs if r["temperature"] == temp and r["concurrency"] == rows]
            first = {(r["drafter"], r["batch_invariant"]): r for r in cell if r["repeat"] == 0}  # the outputs
            for name in names:
                by = {s: {r["repeat"]: r for r in cell if r["drafter"] == name and r["batch_invariant"] == s}
                      for s in SETTINGS}
                ratios = [by[False][rep]["tokens_per_s"] / by[True][rep]["tokens_per_s"] for rep in by[True]]
                row: dict = {"drafter": name, "temperature": temp, "concurrency": rows,
                             "fused_over_invariant": statistics.median(ratios),
                             "fused_over_invariant_range": [min(ratios), max(ratios)]}
                for s, label in ((True, "invariant"), (False, "fused")):
                    mine = list(by[s].values())
                    taus = [r["tau"] for r in mine if r["tau"] is not None]
                    row[f"{label}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in mine)
                    row[f"{label}_tau"] = statistics.mean(taus) if taus else None
                    if temp == 0 and name != PLAIN:
                        same = [a == b for a, b in zip(first[name, s]["token_ids"], first[PLAIN, s]["token_ids"],
                                                       strict=True)]
                        row[f"{label}_greedy_identical_to_plain"] = f"{sum(same)}/{len(same)}"
                row["other_cores_max"] = max(r.get("other_cores", 0.0) for s in SETTINGS for r in by[s].values())
                out.append(row)
    return out


def table(summary: list[dict]) -> str:
    lines = ["| T | R | drafter | invariant tok/s | fused tok/s | fused / invariant, median (min–max) | τ invariant, "
             "fused | T = 0 identical to plain: invariant, fused |", "|---" * 8 + "|"]
    for s in summary:
        lo, hi = s["fused_over_invariant_range"]
        tau = "-" if s["invariant_tau"] is None else f"{s['invariant_tau']:.2f}, {s['fused_tau']:.2f}"
        same = (f"{s['invariant_greedy_identical_to_plain']}, {s['fused_greedy_identical_to_plain']}"
                if "invariant_greedy_identical_to_plain" in s else "-")
        lines.append(f"| {s['temperature']:g} | {s['concurrency']} | {s['drafter']} | {s['invariant_tokens_per_s']:.0f} "
                     f"| {s['fused_tokens_per_s']:.0f} | {s['fused_over_invariant']:.3f} ({lo:.3f}–{hi:.3f}) | {tau} "
                     f"| {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    workload_options(ap)
    ap.add_argument("--drafter", action="append", default=[],
                    help="drafter spec besides plain; repeatable (default: dspark-markov; 'plain': none)")
    ap.add_argument("--graphs", default="eager", choices=("eager", "compile"), help="the engine's graph mode")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", required=True, type=Path)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    temps = [float(t) for t in a.temperature.split(",")]
    rows_list = [int(r) for r in a.concurrency.split(",")]

    target = Target.load(None, dtype="bfloat16")
    prompts, sets = held_out_prompts(target, a.dataset, a.skip, a.num_prompts)
    specs = [spec for spec in a.drafter or ["dspark-markov"] if spec != PLAIN]  # --drafter plain: plain decoding only
    drafters = {PLAIN: None} | {spec: load_drafter(spec, target, None, 7) for spec in specs}
    engines = {}  # (drafter, setting, T, R) -> engine: its caches persist across runs
    for name, drafter in drafters.items():
        for setting in SETTINGS:
            for temp in temps:
                for rows in rows_list:
                    cfg = GenerationConfig(max_new_tokens=a.max_new_tokens, temperature=temp, block_size=7,
                                           max_batch=rows, seed=0, graphs=a.graphs, batch_invariant=setting)
                    engine = engines[name, setting, temp, rows] = SpeculativeEngine(target, drafter, cfg, stop_ids=[])
                    engine.generate(prompts[:rows])  # warm-up: first calls, caches sized for the run
                    if a.graphs == "compile":  # every prompt's shapes compiled before the timed runs
                        engine.generate(prompts)
    runs: list[dict] = []
    for rep in range(a.repeats):
        for temp in temps:
            for rows in rows_list:
                for name in drafters:
                    for setting in SETTINGS if rep % 2 == 0 else SETTINGS[::-1]:
                        time.sleep(SETTLE_S)
                        out = _run(engines[name, setting, temp, rows], prompts)
                        runs.append({"drafter": name, "batch_invariant": setting, "repeat": rep, "temperature": temp,
                                     "concurrency": rows, **out})
                        print(f"repeat {rep} T={temp:g} R={rows} {name} {'invariant' if setting else 'fused'}: "
                              f"{out['tokens_per_s']:.1f} tok/s (other cores {out.get('other_cores', '?')})", flush=True)
    summary = _summary(runs, list(drafters), temps, rows_list)
    report = {
        "cpu": cpu_description(), "torch": torch.__version__, "threads": torch.get_num_threads(), "graphs": a.graphs,
        "dtype": "bfloat16", "target": "embedded tiny-target (Qwen3, 6 layers, hidden 256)", "prompt_sets": sets,
        "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "summary": summary,
        "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs],
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(report, indent=1))
    text = (f"CPU: {report['cpu']}; torch {report['torch']}, {report['threads']} threads, bfloat16, graphs {a.graphs}; "
            f"{len(prompts)} prompts ({', '.join(s['dataset'] + ' ' + s['prompts'] for s in sets)}) x "
            f"{a.max_new_tokens} tokens, {a.repeats} interleaved repeats\n\n{table(summary)}\n")
    a.json.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

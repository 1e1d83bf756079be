"""vLLM (its CPU build) serving the embedded target plain and with the vLLM export of each drafter,
measured by ``dspec bench --server``, beside dspec's own engine with the same drafter on the same
prompts: one JSON report, the bench tables and a Markdown summary with the CPU named.

    python -m benchmarks.vllm_exports [--drafter dflash --drafter eagle3] [--dataset FILE ...]
        [--num-prompts N] [--max-new-tokens N] [--temperature 0 --temperature 1] [--repeats N]
        [--concurrency R] [--expand-fix] --out DIR [--json REPORT]

The first ``--num-prompts`` prompts of each ``--dataset`` are pooled into one prompt set
(DIR/prompts.jsonl), so each row covers all of them. For each drafter: ``dspec export --format
vllm`` into DIR/exports/NAME, its server started with the serve command the export wrote in SERVE.md
(:mod:`benchmarks.vllm_cpu`), then for each temperature ``dspec bench --server EXPORT
--baseline-server PLAIN --drafter NAME`` (dspec's row: the drafter against dspec's plain decoding;
vLLM's row: the export against vLLM without speculation, with τ from vLLM's counters and the served
tokens scored by the target). ``--expand-fix`` adds, at T > 0, each export served with vLLM 0.32.0's
CPU sampling defect patched in the server process (``tests/engine_side/expand_fix``;
docs/interop.md): rows with ``"variant": "expand fixed"``. Writes REPORT (default
DIR/vllm-exports.json: every run, the CPU, and ``commands``: each command that ran) and
DIR/vllm-exports.md (the summary table), and prints both. Timed: run it on a quiet machine at
normal priority; the servers and the bench share the CPU one at a time (paired units).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from benchmarks.vllm_cpu import REPO, VllmServer, cpu_description, server_argv, vllm_env
from dspec_cli.cli.bench import render_table
from dspec_cli.core.data import BUILTIN, dataset_name, load_prompts
from dspec_cli.core.files import DEFAULT_TARGET_PATH


def dspec(*args: str) -> None:
    """``dspec ARGS`` in this interpreter (as a user runs it); stops the script with its error."""
    done = subprocess.run([sys.executable, "-m", "dspec_cli", *args], stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"dspec {' '.join(args)} failed: {done.stderr.strip().splitlines()[-1:]}")


def export(name: str, out: Path) -> str:
    """The drafter's vLLM export into ``out``; the serve command it wrote."""
    report = out.parent / f"{name}.export.json"
    dspec("export", str(DEFAULT_TARGET_PATH.parent / "drafters" / name), "--format", "vllm", "--output", str(out),
          "--dtype", "bfloat16", "--json", str(report), "--overwrite")
    return json.loads(report.read_text())["command"]


EXPAND_FIX = {"PYTHONPATH": str(REPO / "tests" / "engine_side" / "expand_fix"), "DSPEC_TEST_FIX_VLLM_EXPAND": "1"}


def pooled_prompts(datasets: list[str], n: int, out: Path) -> Path:
    """The first ``n`` prompts of each dataset in one prompt file (its domain: the dataset's name)."""
    lines = [json.dumps({"turns": [p.text], "domain": dataset_name(d)})
             for d in datasets for p in load_prompts(d, n)]
    out.write_text("\n".join(lines) + "\n")
    return out


def bench_args(a, prompts: Path, temperature: float) -> list[str]:
    return ["--dataset", str(prompts), "--max-new-tokens", str(a.max_new_tokens), "--temperature", str(temperature),
            "--repeats", str(a.repeats), "--concurrency", str(a.concurrency)]


def summary(result: dict) -> str:
    """The Markdown table of every row: T, engine, drafter, tokens/s against the same engine's plain
    decoding, the ratio, τ and the losslessness verdict; the CPU and the set in the line above it."""
    env, runs = result["env"], result["runs"]
    first = runs[0] if runs else {}
    lines = [f"{result['cpu']}; torch {env.get('torch')}, {env.get('dtype')}, {first.get('num_prompts')} prompts × "
             f"{first.get('max_new_tokens')} tokens, R = {first.get('concurrency')}, {first.get('repeats')} repeat(s)", "",
             "| T | engine | drafter | tokens/s | plain tokens/s | ratio | τ | lossless |", "|---|---|---|---|---|---|---|---|"]
    verdict = {True: "yes", False: "**no**", None: "-"}
    for r in sorted(runs, key=lambda r: (r["temperature"], r["drafter"], r.get("engine", "dspec") != "dspec")):
        ratio = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
        lines.append(f"| {r['temperature']:g} | {r.get('engine', 'dspec')} | {r['drafter']} | {r['tokens_per_s']:.0f} | "
                     f"{r['baseline_tokens_per_s']:.0f} | {ratio} | {r['tau']:.2f} | "
                     f"{'-' if r.get('engine', 'dspec') == 'dspec' else verdict[r.get('lossless')]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--drafter", action="append", default=None, help="repeatable (default: dflash, eagle3)")
    ap.add_argument("--dataset", action="append", default=[], help="repeatable (default: the built-in prompts)")
    ap.add_argument("--num-prompts", type=int, default=4, help="the first N of each dataset")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, action="append", default=None, help="repeatable (default: 0 and 1)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--expand-fix", action="store_true", help="also serve each export with vLLM's CPU defect patched")
    ap.add_argument("--out", type=Path, required=True, help="work folder: exports, server logs, each bench's JSON")
    ap.add_argument("--json", type=Path, default=None, help="the report (default: OUT/vllm-exports.json)")
    a = ap.parse_args(argv)
    drafters, temperatures = a.drafter or ["dflash", "eagle3"], a.temperature or [0.0, 1.0]
    a.out.mkdir(parents=True, exist_ok=True)
    prompts = pooled_prompts(a.dataset or [BUILTIN], a.num_prompts, a.out / "prompts.jsonl")
    env_dir = vllm_env()
    runs, commands, env = [], [], {}
    plain_args = ["--model", str(DEFAULT_TARGET_PATH)]
    with VllmServer(env_dir, plain_args, a.out / "plain.log") as plain:
        commands.append(plain.command)
        for name in drafters:
            command = export(name, a.out / "exports" / name)
            variants = [("", {}, temperatures)]
            if a.expand_fix and any(t > 0 for t in temperatures):
                variants.append(("expand fixed", EXPAND_FIX, [t for t in temperatures if t > 0]))
            for variant, extra, temps in variants:
                log = a.out / f"{name}{'-fixed' if variant else ''}.log"
                with VllmServer(env_dir, server_argv(command), log, extra, export_command=command) as server:
                    commands += [command, server.command]
                    for t in temps:
                        report = a.out / f"{name}{'-fixed' if variant else ''}-t{t:g}.json"
                        ours = [] if variant else ["--drafter", name]  # dspec's engine: once per temperature
                        args = ["bench", "--server", server.url, "--baseline-server", plain.url, *ours,
                                *bench_args(a, prompts, t), "--json", str(report)]
                        commands.append(" ".join(["dspec", *args]))
                        dspec(*args)
                        data = json.loads(report.read_text())
                        env = env if variant else data["env"]  # dspec's (the served-only report's dtype is the scorer's)
                        served = [{**r, "drafter": name} for r in data["runs"] if r["engine"] != "dspec"]
                        runs += ([{**r, "variant": variant, "engine": f"{r['engine']} ({variant})"} for r in served]
                                 if variant else [r for r in data["runs"] if r["engine"] == "dspec"] + served)
    result = {"target": "embedded:tiny-target", "cpu": cpu_description(), "env": env,
              "datasets": a.dataset or [BUILTIN], "commands": commands, "runs": runs}
    report = a.json or a.out / "vllm-exports.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(result, indent=2) + "\n")
    for t in temperatures:  # one table per temperature
        render_table({**result, "runs": [r for r in runs if r["temperature"] == t]}, Console(width=250))
    table = summary(result)
    (a.out / "vllm-exports.md").write_text(table)
    print(table)
    print(f"report: {report}; table: {a.out / 'vllm-exports.md'}")


if __name__ == "__main__":
    main()

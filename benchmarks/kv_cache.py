"""KV-cache append micro-benchmark (not a test): plain decoding steps of a target with transformers'
``DynamicLayer`` (concatenates the whole cache on every forward) against ``SlackLayer`` (writes
the new slots into spare capacity; ``dspec_cli.runtime.kv_cache``).

    python -m benchmarks.kv_cache [--target PATH] [--dataset JSONL] [--rows 1,16,64]
        [--steps 96] [--repeats 6] [--device cpu|cuda] [--dtype float32|bfloat16] [--json PATH]

For each R: prefill R prompts of the dataset (default: the built-in set; cycled), then ``--steps`` verify + commit
steps of one token per row, no request leaving; both layer kinds alternate, ``--repeats`` runs
each. Reports ms per step (minimum over runs) and the median of the paired ratios. Requests
leaving (``TargetBatch.remove``) rebuild the cache either way, so a workload of short answers
gains less than these steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers.cache_utils import DynamicLayer

from dspec_cli.core.data import BUILTIN, dataset_name, load_prompts
from dspec_cli.runtime.kv_cache import SlackLayer
from dspec_cli.runtime.target import Target
from dspec_cli.workflows.bench import environment

KINDS = {"dynamic": DynamicLayer, "slack": SlackLayer}


def decode_seconds(target: Target, ids: list[list[int]], steps: int, layer: type) -> float:
    """Wall seconds of ``steps`` plain decoding steps after prefilling ``ids``, with cache layer ``layer``."""
    batch = target.new_batch((), kv_layer=layer)
    target.prefill(batch, ids)
    rows = len(ids)
    tokens = torch.ones(rows, dtype=torch.long, device=target.device)
    ones = torch.ones(rows, dtype=torch.long, device=target.device)
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        target.verify(batch, tokens, ones)
        target.commit(batch, ones)
    sync()
    return time.perf_counter() - t0


def measure(target: Target, dataset: str, rows: list[int], steps: int, repeats: int) -> list[dict]:
    texts = [p.text for p in load_prompts(dataset)]
    out = []
    for r in rows:
        ids = [target.render_prompt(texts[i % len(texts)]) for i in range(r)]
        for layer in KINDS.values():  # warm-up
            decode_seconds(target, ids, 4, layer)
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        for rep in range(repeats):
            for kind in list(KINDS)[:: 1 if rep % 2 == 0 else -1]:
                times[kind].append(decode_seconds(target, ids, steps, KINDS[kind]))
        dyn, slack = min(times["dynamic"]), min(times["slack"])
        paired = [a / b for a, b in zip(times["dynamic"], times["slack"], strict=True)]
        out.append({"rows": r, "steps": steps, "repeats": repeats, "dynamic_ms_per_step": 1e3 * dyn / steps,
                    "slack_ms_per_step": 1e3 * slack / steps, "speedup": dyn / slack,
                    "speedup_paired_median": statistics.median(paired), "speedup_runs": paired})  # fmt: skip
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=None, help="model id or directory (default: the embedded target)")
    p.add_argument("--dataset", default=BUILTIN, help="prompts (jsonl, {\"turns\": [...]} per line)")
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    target = Target.load(args.target, dtype=args.dtype, device=args.device)
    runs = measure(target, args.dataset, [int(r) for r in args.rows.split(",")], args.steps, args.repeats)
    print(f"{'R':>4} {'DynamicLayer ms':>16} {'SlackLayer ms':>14} {'speedup':>8} {'paired median':>14}")
    for r in runs:
        print(f"{r['rows']:>4} {r['dynamic_ms_per_step']:>16.2f} {r['slack_ms_per_step']:>14.2f} "
              f"{r['speedup']:>7.2f}x {r['speedup_paired_median']:>13.2f}x")
    if args.json:
        report = {"target": args.target or "embedded:tiny-target", "dataset": dataset_name(args.dataset),
                  "env": environment(target), "runs": runs}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Verification rules compared on the same drafts (not a test): τ of each rule, paired.

    python -m benchmarks.verify_rules --drafter SPEC [--drafter SPEC ...] [--dataset FILE ...]
        [--num-prompts N] [--max-new-tokens N] [--block-size γ] [--temperature T] [--top-p P]
        [--dtype float32|bfloat16|auto] [--samples K] [--seed S] [--json PATH]

Each drafter generates at R = 1 with the engine's default rules. At every verification (the
engine's ``observe`` callback), the same inputs (target and draft probabilities, the drafts or
the tree) are verified K more times by each rule with fresh coins: token and block verification for chains with draft
probabilities, "sampled" (recursive rejection) and "traversal" for trees of sampled siblings.
Every rule sees exactly the drafts the run produced, so the difference of their mean accepted
drafts carries no drafting noise (a paired estimate; `dspec bench` runs each rule on its own
trajectory). τ_rule = 1 + the mean over rounds of the expected accepted drafts; the table also
gives the ratio and a 95 % interval of the mean paired difference over rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from dspec_cli.checkpoints import load_drafter
from dspec_cli.core.data import BUILTIN, dataset_name, load_prompts
from dspec_cli.core.sampling import torch_uniform
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine, VerifyStep
from dspec_cli.runtime.target import Target
from dspec_cli.runtime.verify import verify_chain_grid, verify_tree_grid
from dspec_cli.workflows.bench import environment

CHAIN_RULES = ("token", "block")
TREE_RULES = ("sampled", "traversal")


def paired(samples: int, seed: int) -> tuple[dict[str, list[float]], Callable[[VerifyStep], None]]:
    """({rule: [per round and row]}, the engine's ``observe`` callback recording, per round, each
    rule's expected accepted drafts (mean over ``samples`` coin sets) on the round's own inputs)."""
    record: dict[str, list[float]] = {}
    gen = torch.Generator().manual_seed(seed)

    def observe(step: VerifyStep) -> None:
        probs, drafts, q = (t.repeat(samples, *[1] * (t.dim() - 1)) for t in (step.target_probs, step.drafts, step.draft_probs))
        n = drafts.shape[0]
        if step.parents is None:  # a chain
            assert step.num_draft is not None  # chains carry their lengths
            ell = step.num_draft.repeat(samples)
            for rule in CHAIN_RULES:
                coins = torch_uniform(tuple(drafts.shape), generator=gen)
                res = verify_chain_grid(probs, drafts, q, ell, method=rule, uniforms=coins,
                                        final_uniforms=torch_uniform((n,), generator=gen), backend="torch")
                record.setdefault(rule, []).extend(res.accepted.view(samples, -1).double().mean(0).tolist())
            return
        parents = step.parents.repeat(samples, 1)
        for rule in TREE_RULES:
            seeds = torch.randint(1 << 62, (n,), generator=gen)
            res = verify_tree_grid(probs, drafts, parents, depth=step.depth, fanout=step.fanout, method=rule,
                                   draft_probs=q, seeds=seeds, offsets=torch.zeros_like(seeds))
            record.setdefault(rule, []).extend(res.accepted.view(samples, -1).double().mean(0).tolist())

    return record, observe


def summary(record: dict[str, list[float]]) -> dict:
    """τ per rule, the second rule's ratio to the first and a 95 % interval of the paired gain."""
    rules = [r for r in (*CHAIN_RULES, *TREE_RULES) if r in record]
    out = {"rounds": len(record[rules[0]]) if rules else 0, "tau": {r: 1 + statistics.fmean(record[r]) for r in rules}}
    if len(rules) == 2:
        a, b = record[rules[0]], record[rules[1]]
        diff = [y - x for x, y in zip(a, b, strict=True)]
        half = 1.96 * statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else float("nan")
        mean = statistics.fmean(diff)
        out.update(ratio=out["tau"][rules[1]] / out["tau"][rules[0]], gain=mean, gain_ci95=[mean - half, mean + half])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.verify_rules", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--drafter", action="append", required=True, help="drafter spec (repeatable), as dspec bench's")
    ap.add_argument("--dataset", action="append", default=[], help="prompt file or builtin (repeatable)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--samples", type=int, default=32, help="coin sets per rule and round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    target = Target.load(args.target, dtype=args.dtype, device="cpu")
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           block_size=args.block_size, seed=args.seed)
    runs = []
    for spec in args.drafter:
        drafter = load_drafter(spec, target, None, args.block_size)
        for dset in args.dataset or [BUILTIN]:
            prompts = [target.render_prompt(p.text) for p in load_prompts(dset, args.num_prompts)]
            record, observe = paired(args.samples, args.seed)
            SpeculativeEngine(target, drafter, cfg, observe=observe).generate(prompts)
            runs.append({"drafter": spec, "dataset": dataset_name(dset), **summary(record)})
            r = runs[-1]
            taus = ", ".join(f"{k} {v:.3f}" for k, v in r["tau"].items())
            gain = f"; ratio {r['ratio']:.3f}, gain {r['gain']:+.3f} [{r['gain_ci95'][0]:+.3f}, {r['gain_ci95'][1]:+.3f}]" \
                if "ratio" in r else ""
            print(f"{spec} · {r['dataset']} · {r['rounds']} rounds: τ {taus}{gain}", flush=True)
    report = {"env": environment(target), "config": vars(args) | {"json": str(args.json)}, "runs": runs}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Our engine against transformers' own assisted generation, same target and drafts, one run.

    python -m dspec_cli.benchmarks.hf_assisted [--target PATH] [--draft-model PATH]
        [--dataset FILE ...] [--num-prompts N] [--max-new-tokens N] [--block-size γ]
        [--temperature T] [--json PATH]

R = 1 (transformers' assisted generation is single-request). Four pairs are timed prompt by
prompt, each ours vs transformers: plain decoding, draft-model (`generate(assistant_model=...)`
with a constant γ), prompt lookup (`prompt_lookup_num_tokens=γ`). Stop tokens are disabled in
both so every run generates exactly --max-new-tokens tokens; the table reports tokens/s and
the ratio ours / transformers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from dspec_cli.bench import environment
from dspec_cli.data import BUILTIN, dataset_name, load_prompts
from dspec_cli.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.plugins import get_drafter_class
from dspec_cli.target import Target, embedded_path


def _hf_generate(target: Target, ids: list[int], args, **extra) -> float:
    inp = torch.tensor([ids], device=target.device)
    sample = args.temperature > 0
    kwargs = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=sample,
                  eos_token_id=None, pad_token_id=0, **extra)
    if sample:
        kwargs.update(temperature=args.temperature, top_k=0, top_p=1.0)
    t0 = time.perf_counter()
    target.model.generate(inp, **kwargs)
    return time.perf_counter() - t0


def _ours(target: Target, drafter, ids: list[int], args) -> float:
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, block_size=args.block_size,
                           seed=args.seed)
    t0 = time.perf_counter()
    SpeculativeEngine(target, drafter, cfg, stop_ids=[]).generate([ids])
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--dataset", action="append", default=[])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    target = Target.load(args.target)
    draft_path = args.draft_model or str(embedded_path("tiny-draft-model"))
    draft_target = Target.load(draft_path)
    dm_cls, pl_cls = get_drafter_class("draft-model"), get_drafter_class("prompt-lookup")
    drafters = {
        "plain": (None, {}),
        "draft-model": (dm_cls(dm_cls.config_class(block_size=args.block_size), target, model=draft_target),
                        dict(assistant_model=draft_target.model, num_assistant_tokens=args.block_size,
                             num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)),
        "prompt-lookup": (pl_cls.build(pl_cls.config_class(block_size=args.block_size), target),
                          dict(prompt_lookup_num_tokens=args.block_size)),
    }
    rows = []
    for dset in args.dataset or [BUILTIN]:
        prompts = [target.render_prompt(p.text) for p in load_prompts(dset, args.num_prompts)]
        for name, (drafter, hf_extra) in drafters.items():
            _ours(target, drafter, prompts[0], args)  # warm-up both paths
            _hf_generate(target, prompts[0], args, **hf_extra)
            ours = sum(_ours(target, drafter, ids, args) for ids in prompts)
            hf = sum(_hf_generate(target, ids, args, **hf_extra) for ids in prompts)
            ntok = args.max_new_tokens * len(prompts)
            rows.append({"dataset": dataset_name(dset), "method": name, "num_prompts": len(prompts),
                         "ours_tokens_per_s": ntok / ours, "transformers_tokens_per_s": ntok / hf,
                         "ratio": hf / ours})
    report = {"env": environment(target), "temperature": args.temperature, "block_size": args.block_size,
              "max_new_tokens": args.max_new_tokens, "rows": rows}
    table = Table(title=f"dspec engine vs transformers generate (R=1, T={args.temperature}, γ={args.block_size})")
    for col in ("dataset", "method", "ours tok/s", "transformers tok/s", "ours / transformers"):
        table.add_column(col, justify="left" if col in ("dataset", "method") else "right")
    for r in rows:
        table.add_row(r["dataset"], r["method"], f"{r['ours_tokens_per_s']:.1f}", f"{r['transformers_tokens_per_s']:.1f}",
                      f"{r['ratio']:.2f}x")
    Console(width=120).print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()

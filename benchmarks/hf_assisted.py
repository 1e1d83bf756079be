"""Our engine against transformers' own assisted generation, same target and drafts, one run.

    python -m benchmarks.hf_assisted [--target PATH] [--draft-model PATH]
        [--dataset FILE ...] [--num-prompts N] [--max-new-tokens N] [--block-size γ]
        [--temperature T] [--repeats N] [--threads N] [--hf-assistant constant|default] [--json PATH]

R = 1 (transformers' assisted generation is single-request). Three pairs are timed, each ours
vs transformers: plain decoding, draft-model (`generate(assistant_model=...)`), prompt lookup
(`prompt_lookup_num_tokens=γ`). transformers reads the assistant's settings from the
assistant model's own generation config: `--hf-assistant constant` (default) sets a constant
γ there with no confidence cut-off, as our engine drafts; `default` leaves transformers'
defaults (up to 20 drafts, stop below confidence 0.4). Stop tokens are disabled in both so
every run generates exactly --max-new-tokens tokens. Runs alternate between the two sides
prompt by prompt (on a loaded machine both see the same load); the table reports tokens/s
from wall time and the ratios ours / transformers of wall time and of process CPU time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from dspec_cli.core.data import BUILTIN, dataset_name, load_prompts
from dspec_cli.core.files import embedded_path
from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.target import Target
from dspec_cli.workflows.bench import environment


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of fn()."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def _hf_generate(target: Target, ids: list[int], args, **extra) -> tuple[float, float]:
    inp = torch.tensor([ids], device=target.device)
    sample = args.temperature > 0
    kwargs = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=sample,
                  eos_token_id=None, pad_token_id=0, **extra)
    if sample:
        kwargs.update(temperature=args.temperature, top_k=0, top_p=1.0)
    return _timed(lambda: target.model.generate(inp, **kwargs))


def _ours(target: Target, drafter, ids: list[int], args) -> tuple[float, float]:
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, block_size=args.block_size,
                           seed=args.seed)
    return _timed(lambda: SpeculativeEngine(target, drafter, cfg, stop_ids=[]).generate([ids]))


def _assistant(draft_target: Target, args) -> dict:
    """generate() kwargs for assisted generation; a constant γ is set where transformers reads it."""
    if args.hf_assistant == "constant":
        gc = draft_target.model.generation_config
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = args.block_size, "constant"
        gc.assistant_confidence_threshold = 0.0  # 0 disables the confidence stop
    return dict(assistant_model=draft_target.model)


def _pair(target: Target, drafter, hf_extra: dict, prompts: list[list[int]], args) -> dict:
    """Warm both sides up, then time them alternately over every prompt, ``args.repeats`` times."""
    _ours(target, drafter, prompts[0], args)
    _hf_generate(target, prompts[0], args, **hf_extra)
    ours, hf = [0.0, 0.0], [0.0, 0.0]  # wall, CPU seconds
    sides = [(ours, lambda ids: _ours(target, drafter, ids, args)),
             (hf, lambda ids: _hf_generate(target, ids, args, **hf_extra))]
    for i, ids in enumerate(prompts * args.repeats):
        for acc, run in sides if i % 2 == 0 else sides[::-1]:  # alternate who goes first
            wall, cpu = run(ids)
            acc[0] += wall
            acc[1] += cpu
    ntok = args.max_new_tokens * len(prompts) * args.repeats
    return {"ours_tokens_per_s": ntok / ours[0], "transformers_tokens_per_s": ntok / hf[0],
            "ratio": hf[0] / ours[0], "cpu_ratio": hf[1] / ours[1]}


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
    ap.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--hf-assistant", choices=("constant", "default"), default="constant")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    target = Target.load(args.target)
    draft_path = args.draft_model or str(embedded_path("tiny-draft-model"))
    draft_target = Target.load(draft_path)
    dm_cls, pl_cls = get_drafter_class("draft-model"), get_drafter_class("prompt-lookup")
    drafters = {
        "plain": (None, {}),
        "draft-model": (dm_cls(dm_cls.config_class(block_size=args.block_size), target, model=draft_target),
                        _assistant(draft_target, args)),
        "prompt-lookup": (pl_cls.build(pl_cls.config_class(block_size=args.block_size), target),
                          dict(prompt_lookup_num_tokens=args.block_size)),
    }
    rows = []
    for dset in args.dataset or [BUILTIN]:
        prompts = [target.render_prompt(p.text) for p in load_prompts(dset, args.num_prompts)]
        for name, (drafter, hf_extra) in drafters.items():
            row = _pair(target, drafter, hf_extra, prompts, args)
            rows.append({"dataset": dataset_name(dset), "method": name, "num_prompts": len(prompts), **row})
    report = {"env": environment(target), "temperature": args.temperature, "block_size": args.block_size,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "hf_assistant": args.hf_assistant,
              "rows": rows}
    table = Table(title=f"dspec engine vs transformers generate (R=1, T={args.temperature}, γ={args.block_size}, "
                        f"assistant {args.hf_assistant})")
    for col in ("dataset", "method", "ours tok/s", "transformers tok/s", "ours / transformers", "CPU time ratio"):
        table.add_column(col, justify="left" if col in ("dataset", "method") else "right")
    for r in rows:
        table.add_row(r["dataset"], r["method"], f"{r['ours_tokens_per_s']:.1f}", f"{r['transformers_tokens_per_s']:.1f}",
                      f"{r['ratio']:.2f}x", f"{r['cpu_ratio']:.2f}x")
    Console(width=120).print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()

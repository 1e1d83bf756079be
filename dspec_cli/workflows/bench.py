"""``dspec bench``: τ, acceptance by position and speedup against plain decoding, same run."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dspec_cli.checkpoints import load_drafter
from dspec_cli.checkpoints.hub import resolve_checkpoint
from dspec_cli.core import plugins
from dspec_cli.core.data import BUILTIN, dataset_name, load_prompts
from dspec_cli.core.devices import parse_dtype, resolve_device
from dspec_cli.core.errors import DspecError
from dspec_cli.core.hardware import CostTable, device_name
from dspec_cli.core.specs import parse_drafter_spec, parse_scheduler_spec
from dspec_cli.core.version import __version__
from dspec_cli.runtime.engine import GenerationConfig, RunStats, SpeculativeEngine
from dspec_cli.runtime.schedule import build_scheduler
from dspec_cli.runtime.target import Target
from dspec_cli.workflows.metrics import acceptance, generated_tokens, ratio_interval


@dataclass
class BenchOptions:
    drafters: Sequence[str]
    target: str | None = None
    checkpoints: Sequence[str] = ()
    datasets: Sequence[str] = ()
    num_prompts: int | None = None
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    block_size: int = 7
    seed: int = 0
    concurrency: Sequence[int] = (1,)
    schedulers: Sequence[str] = ("fixed",)
    cost_table: str | None = None
    strict: bool = False
    device: str = "auto"
    dtype: str = "auto"
    warmup: bool = True
    repeats: int = 1  # timed runs per engine, interleaved; tokens/s is the median
    verify: Sequence[str] = ()  # verification rules by name (verify_config); () = the engine's defaults
    extra: dict = field(default_factory=dict)


VERIFY_RULES = {"token": "chain_verify", "block": "chain_verify", "sampled": "tree_verify", "traversal": "tree_verify"}


def verify_config(names: Sequence[str]) -> dict:
    """GenerationConfig fields for ``--verify`` names: token or block for chains, sampled or
    traversal for sampled trees (at most one of each)."""
    fields: dict[str, str] = {}
    for name in names:
        key = VERIFY_RULES.get(name)
        if key is None:
            raise DspecError(f"--verify: unknown rule {name!r}; chains: token, block; sampled trees: sampled, traversal")
        if fields.get(key, name) != name:
            raise DspecError(f"--verify: {fields[key]!r} and {name!r} are both rules for the same drafts; give one")
        fields[key] = name
    return fields


def verify_report(rules: dict[str, int], config: GenerationConfig) -> dict:
    """The verification a run used: ``verify`` (the rule of most drafted rounds: token, block,
    greedy, match, sampled or traversal; "-" without drafts), the drafted rounds per rule and, where
    the configured block rule could not apply, why."""
    out = {"verify": max(rules, key=lambda r: rules[r]) if rules else "-", "verify_rounds": dict(rules)}
    if config.chain_verify == "block" and "token" in rules:
        out["verify_note"] = ("no draft probabilities (one-hot drafts): verified token by token; block verification "
                              "needs q and accepts the same as the token rule for one-hot drafts")
    return out


def environment(target: Target) -> dict:
    import transformers

    return {
        "dspec": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(target.device),
        "device_name": device_name(target.device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "dtype": str(target.dtype).replace("torch.", ""),
    }


def _schedulers(opts: BenchOptions, target: Target) -> list[tuple[str, object]]:
    """(name, scheduler) pairs; hardware-aware ones need a cost table from `dspec profile-hardware`."""
    if list(opts.schedulers) == ["fixed"] and not opts.cost_table:
        return [("fixed", None)]
    table = None
    if opts.cost_table:
        table = CostTable.load(opts.cost_table, block_size=opts.block_size)
        table.check(device=target.device, model=opts.target or "embedded:tiny-target", strict=opts.strict)
    out = []
    for spec in opts.schedulers:
        name, options = parse_scheduler_spec(spec)  # unknown names list the known ones
        if plugins.get_scheduler_class(name).needs_cost_table and table is None:
            raise DspecError(f"--scheduler {name} needs --cost-table (write one with `dspec profile-hardware --json PATH`)")
        out.append((spec, build_scheduler(name, table, **options)))
    return out


def warm_up(engines, ids) -> None:
    """One short untimed run per engine on ``ids`` (a full batch), with the engine's scheduler:
    the draft gate measures drafting at this R, CUDA/BLAS pick their kernels."""
    for _, _, eng in engines:
        cfg = GenerationConfig(**{**eng.config.__dict__, "max_new_tokens": min(8, eng.config.max_new_tokens)})
        SpeculativeEngine(eng.target, eng.drafter, cfg, scheduler=eng.scheduler, stop_ids=eng.stop_ids).generate(ids)


def run_interleaved(engines, ids, repeats: int, conc: int, dset: str, progress) -> list[list[tuple[list, float, RunStats]]]:
    """Run every engine ``repeats`` times, round-robin, so drifting machine load hits all alike;
    repeat r starts at engine r mod n (baseline, drafter 1, ..., then drafter 1, ..., baseline, ...)
    so no engine always runs right after the same one. Returns per engine [(results, tokens/s,
    RunStats)] by repeat; each engine's ``stats`` hold its first repeat."""
    timed: list[list[tuple[list, float, RunStats]]] = [[] for _ in engines]
    n = len(engines)
    for rep in range(repeats):
        for i in [(rep + j) % n for j in range(n)]:
            name, sname, eng = engines[i]
            label = name if sname in ("-", "fixed") else f"{name} · {sname}"
            label += f" · R={conc}" + (f" · {rep + 1}/{repeats}" if repeats > 1 else "")
            cb = progress(f"{dataset_name(dset)} · {label}", len(ids)) if progress else (lambda _res: None)
            stats = eng.stats
            eng.stats = RunStats()
            t0 = time.perf_counter()
            results = eng.generate(ids, on_finish=cb)
            wall = time.perf_counter() - t0
            run_stats = eng.stats
            if rep:
                eng.stats = stats
            timed[i].append((results, generated_tokens(results) / wall if wall > 0 else 0.0, run_stats))
    return timed


PHASES = ("draft", "verify", "forward", "accept", "update", "prefill", "other")


def phase_ms_per_round(stats: RunStats) -> dict[str, float]:
    """Milliseconds per round of each engine phase: draft (drafter, incl. catching up), verify =
    forward (target forward of the verified tokens) + accept (target probabilities, rejection
    sampling or tree walk) + update (target cache commit, drafter advance), prefill of joining
    requests, other (bookkeeping, retiring)."""
    if not stats.rounds:
        return {}
    return {k: 1e3 * getattr(stats, f"{k}_seconds") / stats.rounds for k in PHASES}


def speedup_bound(tau: float, budget: float, rows: int, reps: list[tuple[list, float, RunStats]],
                  baseline: list[tuple[list, float, RunStats]], cost_table: CostTable | None = None) -> dict:
    """What the measured τ allows if drafting and host work were free: τ times the cost of a plain
    step over the cost of a verify step. From the cost table where one is given (padded verify of
    ``rows`` rows at the mean ``budget`` ℓ + 1: τ · SPS(R·budget) / SPS(R)), else from this run's
    target forwards against the baseline's (plain steps)."""
    if cost_table is not None:
        return {"speedup_bound": tau * cost_table.sps(rows * budget) / cost_table.sps(rows),
                "speedup_bound_source": "cost_table"}
    run = [sum(s.forward_seconds for _, _, s in reps), sum(s.rounds for _, _, s in reps)]
    base = [sum(s.forward_seconds for _, _, s in baseline), sum(s.rounds for _, _, s in baseline)]
    if not all(run + base):
        return {"speedup_bound": None, "speedup_bound_source": None}
    return {"speedup_bound": tau * (base[0] / base[1]) / (run[0] / run[1]), "speedup_bound_source": "measured"}


def run_metrics(reps: list[tuple[list, float, RunStats]], baseline: list[tuple[list, float, RunStats]], stats: RunStats,
                block_size: int, cost_table: CostTable | None = None, rows: int = 1) -> dict:
    """Acceptance, speed and serving metrics of one engine's timed repeats (:func:`run_interleaved`)
    against the plain-decoding baseline's; outputs and statistics come from the first repeat.

    speedup is the median over repeats of tokens/s / the baseline's tokens/s of the same repeat
    (paired: a slow phase of the machine that hits both cancels out)."""
    results = reps[0][0]
    tps_runs = [tps for _, tps, _ in reps]
    base_runs = [tps for _, tps, _ in baseline]
    tps = statistics.median(tps_runs)
    paired = [a / b for a, b in zip(tps_runs, base_runs) if b > 0]
    busy = stats.draft_seconds + stats.verify_seconds + stats.prefill_seconds + stats.other_seconds
    latency = [r.end_time - r.start_time for r in results if r.end_time > r.start_time]
    per_user = sum(len(r.output_ids) / t for r, t in zip(results, latency)) / len(latency) if latency else 0.0
    budgets = [v + 1 for r in results for v in r.verified]
    accepted = acceptance(results, block_size)
    budget = sum(budgets) / len(budgets) if budgets else 1.0
    return {
        **accepted,
        "generated_tokens": generated_tokens(results),
        "repeats": len(reps),
        "wall_seconds": generated_tokens(results) / tps if tps else 0.0,
        "tokens_per_s": tps,
        "tokens_per_s_runs": tps_runs,
        "throughput_tokens_per_s": tps,
        "per_user_tokens_per_s": per_user,
        "mean_verify_budget": sum(budgets) / len(budgets) if budgets else 0.0,
        "baseline_tokens_per_s": statistics.median(base_runs),
        "baseline_tokens_per_s_runs": base_runs,
        "speedup": statistics.median(paired) if paired else None,
        "speedup_runs": paired,
        **_interval(paired),
        "drafted_round_share": stats.drafted_rounds / stats.rounds if stats.rounds else 0.0,
        "drafted_round_share_runs": [s.drafted_rounds / s.rounds if s.rounds else 0.0 for _, _, s in reps],
        "draft_time_share": stats.draft_seconds / busy if busy else 0.0,
        "verify_time_share": stats.verify_seconds / busy if busy else 0.0,
        "phase_ms_per_round": phase_ms_per_round(stats),
        **speedup_bound(accepted["tau"], budget, rows, reps, baseline, cost_table),
    }


def _interval(paired: list[float]) -> dict:
    """speedup_geomean and speedup_ci95 ([low, high], 95 % t-interval) of the paired ratios
    (two repeats or more): what a comparison on this machine can resolve."""
    interval = ratio_interval(paired)
    if interval is None:
        return {}
    mean, low, high = interval
    return {"speedup_geomean": mean, "speedup_ci95": [low, high]}


def format_speedup(run: dict) -> str:
    """The speedup cell: "1.03x", or with several repeats "1.03x (0.95–1.08)" (the median and the
    range of the paired ratios)."""
    if run.get("speedup") is None:
        return "-"
    text = f"{run['speedup']:.2f}x"
    runs = run.get("speedup_runs") or []
    return text + (f" ({min(runs):.2f}–{max(runs):.2f})" if len(runs) > 1 else "")


def drafted_share(run: dict) -> float | None:
    """Share of rounds that drafted, over every repeat when the report lists them."""
    runs = run.get("drafted_round_share_runs")
    return sum(runs) / len(runs) if runs else run.get("drafted_round_share")


def fitting_prompts(target: Target, prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int,
                    *, strict: bool = False, where: str = "prompts") -> tuple[list, int]:
    """The prompt ids that fit the target's context with ``max_new_tokens`` (and a verify block)
    after them, and how many did not. None fitting, or any not fitting with ``strict``, is an error."""
    max_ctx = getattr(target.config, "max_position_embeddings", None)
    if not max_ctx:
        return list(prompts), 0
    room = max_ctx - max_new_tokens - block_size - 1
    kept = [p for p in prompts if len(p) <= room]
    skipped = len(prompts) - len(kept)
    if skipped and (strict or not kept):
        longest = max(len(p) for p in prompts)
        raise DspecError(
            f"{where}: {skipped} of {len(prompts)} prompt(s) do not fit the target's context of {max_ctx} tokens "
            f"with --max-new-tokens {max_new_tokens} (longest {longest} tokens)"
            + ("" if kept else "; lower --max-new-tokens or use a target with a longer context")
        )
    return kept, skipped


def run_bench(opts: BenchOptions, progress: Callable[[str, int], Callable] | None = None) -> dict:
    """Run every (dataset, drafter, concurrency) and the plain-decoding baseline; return the JSON dict.

    ``progress(description, total)`` returns a per-request callback (for progress bars).
    """
    if opts.block_size < 1:
        raise DspecError(f"--block-size must be >= 1, got {opts.block_size}")
    if any(c < 1 for c in opts.concurrency):
        raise DspecError("--concurrency values must be >= 1")
    if opts.repeats < 1:
        raise DspecError(f"--repeats must be >= 1, got {opts.repeats}")
    if opts.checkpoints and len(opts.checkpoints) != len(opts.drafters):
        raise DspecError("give one --checkpoint per --drafter (in the same order; '' for the default), or none")
    for name in opts.drafters:
        parse_drafter_spec(name)  # unknown names and options fail before any model loads
    for spec in opts.schedulers:
        name, _ = parse_scheduler_spec(spec)
        if plugins.get_scheduler_class(name).needs_cost_table and not opts.cost_table:
            raise DspecError(f"--scheduler {name} needs --cost-table (write one with `dspec profile-hardware --json PATH`)")
    if opts.cost_table:
        CostTable.load(opts.cost_table, block_size=opts.block_size)  # a missing or malformed table fails before any model loads
    rules = verify_config(opts.verify)
    GenerationConfig(max_new_tokens=opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k,
                     top_p=opts.top_p, block_size=opts.block_size, **rules)  # sampling options checked up front
    resolve_device(opts.device), parse_dtype(opts.dtype)
    datasets = list(opts.datasets) or [BUILTIN]
    prompt_sets = {d: load_prompts(d, opts.num_prompts) for d in datasets}
    # checkpoints (local or downloaded) before the target loads: a missing one fails first
    checkpoints = [str(resolve_checkpoint(c)) if c else None for c in opts.checkpoints] or [None] * len(opts.drafters)
    target = Target.load(opts.target, dtype=opts.dtype, device=opts.device)
    bound_table = CostTable.load(opts.cost_table, block_size=opts.block_size) if opts.cost_table else None
    schedulers = [_schedulers(opts, target) for _ in opts.drafters]  # per drafter: the draft gate learns its cost
    drafters = [load_drafter(name, target, ckpt, opts.block_size) for name, ckpt in zip(opts.drafters, checkpoints)]
    runs = []
    for dset, prompts in prompt_sets.items():
        ids, skipped = fitting_prompts(target, [target.render_prompt(p.text) for p in prompts], opts.max_new_tokens,
                                       opts.block_size, strict=opts.strict, where=f"--dataset {dset}")
        for conc in opts.concurrency:
            cfg = GenerationConfig(
                max_new_tokens=opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k,
                top_p=opts.top_p, block_size=opts.block_size, max_batch=conc, seed=opts.seed, **rules,
            )
            engines = [("baseline", "-", SpeculativeEngine(target, None, cfg))]
            engines += [
                (name, sname, SpeculativeEngine(target, d, cfg, scheduler=sched))
                for name, d, scheds in zip(opts.drafters, drafters, schedulers)
                for sname, sched in scheds
            ]
            if opts.warmup:
                warm_up(engines, ids[:conc])
            timed = run_interleaved(engines, ids, opts.repeats, conc, dset, progress)
            for (name, sname, eng), reps in zip(engines[1:], timed[1:]):
                runs.append(
                    {
                        "drafter": name,
                        "scheduler": sname,
                        "dataset": dataset_name(dset),
                        "concurrency": conc,
                        "num_prompts": len(ids),
                        "skipped_prompts": skipped,
                        "max_new_tokens": opts.max_new_tokens,
                        "temperature": opts.temperature,
                        "top_p": opts.top_p,
                        "top_k": opts.top_k,
                        "block_size": opts.block_size,
                        **verify_report(eng.stats.verify_rules, cfg),
                        **run_metrics(reps, timed[0], eng.stats, opts.block_size, bound_table, conc),
                    }
                )
    return {
        "target": opts.target or "embedded:tiny-target",
        "env": environment(target),
        "runs": runs,
    }

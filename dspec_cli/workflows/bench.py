"""``dspec bench``: τ, acceptance by position and speedup against plain decoding, same run."""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import torch

from dspec_cli.checkpoints import load_drafter
from dspec_cli.checkpoints.hub import resolve_checkpoint
from dspec_cli.checkpoints.native import choose_target
from dspec_cli.core import plugins
from dspec_cli.core.chat_template import default_kwargs
from dspec_cli.core.cpu_load import CpuMeter
from dspec_cli.core.data import BUILTIN, Prompt, dataset_name, load_prompts
from dspec_cli.core.devices import parse_dtype, resolve_device
from dspec_cli.core.errors import DspecError
from dspec_cli.core.hardware import CostTable, device_name
from dspec_cli.core.sampling import SamplingConfig
from dspec_cli.core.specs import (
    check_block_size,
    parse_drafter_spec,
    parse_scheduler_spec,
)
from dspec_cli.core.version import __version__
from dspec_cli.runtime.drafter import warn_if_other_kwargs
from dspec_cli.runtime.engine import (
    GenerationConfig,
    RequestResult,
    RunStats,
    SpeculativeEngine,
)
from dspec_cli.runtime.schedule import Scheduler, build_scheduler
from dspec_cli.runtime.target import Target
from dspec_cli.workflows.metrics import (
    acceptance,
    generated_tokens,
    median_ci95,
    predicted_tau,
)


@dataclass(frozen=True, kw_only=True)
class BenchOptions(SamplingConfig):
    """What ``dspec bench`` was asked for (docs/bench.md): sampling (the inherited fields) and the rest."""

    drafters: Sequence[str]
    target: str | None = None
    checkpoints: Sequence[str] = ()
    datasets: Sequence[str] = ()
    num_prompts: int | None = None
    max_new_tokens: int = 64
    block_size: int = 7
    concurrency: Sequence[int] = (1,)
    schedulers: Sequence[str] = ("fixed",)
    cost_table: str | None = None
    strict: bool = False
    device: str = "auto"
    dtype: str = "auto"
    warmup: bool = True
    repeats: int = 1  # passes over the prompts, every unit paired with plain decoding
    cuda_graphs: bool = True  # rounds as CUDA graphs on a CUDA device (GenerationConfig.graphs "auto")
    compile: bool = False  # rounds under torch.compile (GenerationConfig.graphs "compile"; wins over cuda_graphs)
    batch_invariant: bool | None = None  # batch-invariant target forwards; None: the default rule (GenerationConfig)
    chat_template_kwargs: dict = field(default_factory=default_kwargs)  # how prompts are rendered
    verify: Sequence[str] = ()  # verification rules by name (verify_config); () = the engine's defaults
    extra: dict = field(default_factory=dict)

    def graphs(self) -> str:
        """GenerationConfig.graphs of these options."""
        return "compile" if self.compile else "auto" if self.cuda_graphs else "eager"


CHAIN_RULES = ("token", "block", "greedy")  # what chain rounds report as their rule
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


def unapplied_verify(asked: Sequence[str], run: dict) -> list[str]:
    """A warning for each ``--verify`` rule that no drafted round of ``run`` was verified by (the
    rule fits drafts this drafter does not make, or greedy decoding matched instead)."""
    used = run.get("verify_rounds", {})
    return [f"--verify {rule}: no round of {run['drafter']} used it (its rounds: "
            f"{', '.join(f'{r} {n}' for r, n in used.items()) or 'none drafted'})" for rule in asked if rule not in used]


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


def _schedulers(opts: BenchOptions, target: Target) -> list[tuple[str, Scheduler | None]]:
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


@dataclass
class Timed:
    """One engine's run over one unit of prompts: its outputs, wall seconds and engine statistics."""

    results: list[RequestResult]
    seconds: float
    stats: RunStats

    @property
    def tokens(self) -> int:
        return generated_tokens(self.results)


def prompt_units(ids: Sequence[Sequence[int]], seed: int, rows: int) -> list[tuple[list, list[int]]]:
    """The prompts in units of ``rows`` (one full batch each) with their per-request seeds, which
    depend on the prompt's index only, so every engine and repeat draws the same streams."""
    seeds = [seed * 1_000_003 + i for i in range(len(ids))]
    return [(list(ids[i : i + rows]), seeds[i : i + rows]) for i in range(0, len(ids), rows)]


def run_paired(engines, units, repeats: int, on_finish: Callable | None = None,
               clock: Callable[[], float] = time.perf_counter) -> list[list[list[Timed]]]:
    """Every engine on one unit of prompts before any engine moves to the next, so plain and
    speculative decoding of the same prompts run seconds apart and a change in the machine's load
    hits both. The order rotates: unit u of repeat r starts at engine (u + r) mod n. Returns
    timed[engine][repeat][unit]."""
    n = len(engines)
    timed: list[list[list[Timed]]] = [[[] for _ in range(repeats)] for _ in engines]
    for rep in range(repeats):
        for u, (ids, seeds) in enumerate(units):
            for i in [(u + rep + j) % n for j in range(n)]:
                eng = engines[i][2]
                eng.stats = RunStats()
                t0 = clock()
                results = eng.generate(ids, seeds=seeds, on_finish=on_finish)
                timed[i][rep].append(Timed(results, clock() - t0, eng.stats))
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


def total_stats(runs: Sequence[Timed]) -> RunStats:
    """The engine statistics of several runs added up."""
    total = RunStats()
    for run in runs:
        for f in fields(RunStats):
            value = getattr(run.stats, f.name)
            if isinstance(value, dict):  # counts by key
                merged = getattr(total, f.name)
                for key, n in value.items():
                    merged[key] = merged.get(key, 0) + n
            else:
                setattr(total, f.name, getattr(total, f.name) + value)
    return total


def tokens_per_s(runs: Sequence[Timed]) -> float:
    seconds = sum(r.seconds for r in runs)
    return sum(r.tokens for r in runs) / seconds if seconds > 0 else 0.0


def paired_ratios(spec: Sequence[Timed], base: Sequence[Timed]) -> tuple[list[float], list[float]]:
    """Per unit: the drafted run's tokens/s over plain decoding's on the same prompts (the paired
    speedup), and the same with the drafted run timed by its target verify forwards alone (what
    it would reach if drafting, acceptance and host work were free). The second is never below
    the first, pair by pair; a drafted run with no verify rounds bounds at infinity."""
    speedups, bounds = [], []
    for s, b in zip(spec, base, strict=True):
        if min(s.seconds, b.seconds) <= 0 or not (s.tokens and b.tokens):
            continue
        plain = b.tokens / b.seconds
        speedups.append(s.tokens / s.seconds / plain)
        bounds.append(s.tokens / s.stats.forward_seconds / plain if s.stats.forward_seconds > 0 else math.inf)
    return speedups, bounds


def plain_decode_tokens_per_s(runs: Sequence[Timed]) -> float | None:
    """Plain decoding's tokens/s without prefill (the first token of each request comes with its
    prefill): a rate that does not depend on prompt length, so blocks of different prompts compare."""
    seconds = sum(r.seconds - r.stats.prefill_seconds for r in runs)
    tokens = sum(r.tokens - len(r.results) for r in runs)
    return tokens / seconds if seconds > 0 and tokens > 0 else None


def baseline_drift(base: Sequence[Sequence[Timed]]) -> tuple[float, float, float] | None:
    """How far plain decoding's speed moved during the run: its tokens/s without prefill in each
    half of each repeat, in run order, as (largest / smallest - 1, smallest, largest); None with
    fewer than two halves that generated tokens."""
    rates = [plain_decode_tokens_per_s(half) for units in base
             for half in (units[: len(units) // 2], units[len(units) // 2 :]) if half]
    rates = [r for r in rates if r]
    if len(rates) < 2:
        return None
    return max(rates) / min(rates) - 1, min(rates), max(rates)


def cost_table_bound(tau: float, budget: float, rows: int, table: CostTable) -> float:
    """τ · SPS(R · budget) / SPS(R): the speedup τ allows when a verify of ``rows`` rows at the mean
    ``budget`` ℓ + 1 costs what the cost table says and drafting is free."""
    return tau * table.sps(rows * budget) / table.sps(rows)


def paired_metrics(spec: Sequence[Sequence[Timed]], base: Sequence[Sequence[Timed]], block_size: int,
                   cost_table: CostTable | None = None, rows: int = 1) -> dict:
    """Acceptance, speed and serving metrics of one engine's runs (``spec[repeat][unit]``, from
    :func:`run_paired`) against plain decoding's (``base``); outputs and engine statistics come
    from the first repeat.

    speedup is the median of the paired ratios over every unit and repeat, with a distribution-
    free 95 % interval (:func:`median_ci95`); speedup_runs are the medians of each repeat."""
    results = [r for run in spec[0] for r in run.results]
    stats = total_stats(spec[0])
    pairs = [paired_ratios(s, b) for s, b in zip(spec, base, strict=True)]  # per repeat
    speedups = [x for sp, _ in pairs for x in sp]
    bounds = [x for _, bd in pairs for x in bd]
    tps_runs = [tokens_per_s(units) for units in spec]
    base_runs = [tokens_per_s(units) for units in base]
    tps = statistics.median(tps_runs)
    busy = stats.draft_seconds + stats.verify_seconds + stats.prefill_seconds + stats.other_seconds
    timed_results = [r for r in results if r.end_time > r.start_time]  # per user: requests with a duration
    per_user = (sum(len(r.output_ids) / (r.end_time - r.start_time) for r in timed_results) / len(timed_results)
                if timed_results else 0.0)
    budgets = [v + 1 for r in results for v in r.verified]
    accepted = acceptance(results, block_size)
    budget = sum(budgets) / len(budgets) if budgets else 1.0
    if cost_table is not None:
        bound, source = cost_table_bound(accepted["tau"], budget, rows, cost_table), "cost_table"
    else:
        bound = statistics.median(bounds) if bounds else None
        bound, source = (bound if bound is not None and math.isfinite(bound) else None), "paired"
    interval = median_ci95(speedups)
    return {
        **accepted,
        **predicted_tau(results),
        "generated_tokens": generated_tokens(results),
        "repeats": len(spec),
        "pairs": len(speedups),
        "wall_seconds": sum(r.seconds for r in spec[0]),
        "tokens_per_s": tps,
        "tokens_per_s_runs": tps_runs,
        "throughput_tokens_per_s": tps,
        "per_user_tokens_per_s": per_user,
        "mean_verify_budget": sum(budgets) / len(budgets) if budgets else 0.0,
        "baseline_tokens_per_s": statistics.median(base_runs),
        "baseline_tokens_per_s_runs": base_runs,
        "speedup": statistics.median(speedups) if speedups else None,
        "speedup_ci95": list(interval) if interval else None,
        "speedup_runs": [statistics.median(sp) if sp else None for sp, _ in pairs],
        "speedup_runs_ci95": [list(ci) if (ci := median_ci95(sp)) else None for sp, _ in pairs],
        "drafted_round_share": stats.drafted_rounds / stats.rounds if stats.rounds else 0.0,
        "drafted_round_share_runs": [s.drafted_rounds / s.rounds if s.rounds else 0.0
                                     for s in map(total_stats, spec)],
        "draft_time_share": stats.draft_seconds / busy if busy else 0.0,
        "verify_time_share": stats.verify_seconds / busy if busy else 0.0,
        "phase_ms_per_round": phase_ms_per_round(stats),
        "speedup_bound": bound,
        "speedup_bound_source": source if bound is not None else None,
        # the most tokens a round verifies (every row at its widest) and the cost table's largest profiled B
        "max_round_tokens": rows * max(budgets) if budgets else rows,
        "cost_table_max_tokens": cost_table.grid[-1] if cost_table is not None else None,
    }


BASELINE_DRIFT = 0.2  # plain decoding's tokens/s may move this much (as a fraction) within one run
BOUND_SLACK = 0.10  # a speedup without an interval (too few pairs) may exceed its bound by this much unflagged
OTHER_CPU_CORES = 0.5  # other processes may keep this many cores busy on average during a run


def run_warnings(run: dict, drift: tuple[float, float, float] | None) -> list[str]:
    """What makes a run's speedup untrustworthy, each with what to do: rounds wider than the cost
    table reaches, a speedup above its bound (its 95 % interval entirely above it; without an
    interval, by more than BOUND_SLACK), repeats whose 95 % intervals do not overlap, plain
    decoding's speed moving by more than BASELINE_DRIFT (``drift``: :func:`baseline_drift`), other
    processes keeping more than OTHER_CPU_CORES busy (``other_cpu_cores``)."""
    label = f"{run['dataset']} · {run['drafter']}" + ("" if run["scheduler"] in ("-", "fixed") else f" · {run['scheduler']}")
    label += f" · R={run['concurrency']}"
    out = []
    widest, reach = run.get("max_round_tokens"), run.get("cost_table_max_tokens")
    if widest is not None and reach is not None and widest > reach:
        out.append(f"{label}: rounds verify up to {widest} tokens, past the cost table's largest profiled B = "
                   f"{reach}: its bound and the schedulers extrapolate the step time in proportion to B there; "
                   f"profile up to it (`dspec profile-hardware --max-batch-tokens {widest}`)")
    speedup, bound = run.get("speedup"), run.get("speedup_bound")
    ci = run.get("speedup_ci95")
    lowest = ci[0] if ci else (speedup * (1 - BOUND_SLACK) if speedup is not None else None)
    if speedup is not None and bound is not None and lowest is not None and lowest > bound:
        why = ("the cost table does not describe this machine as it ran (profiled under another load or "
               "elsewhere); profile it again with `dspec profile-hardware` on a quiet machine"
               if run.get("speedup_bound_source") == "cost_table"
               else "the timings are inconsistent; rerun on a quiet machine")
        out.append(f"{label}: speedup {speedup:.2f}x exceeds its bound {bound:.2f}x: {why}")
    cis = [ci for ci in run.get("speedup_runs_ci95") or [] if ci]
    if len(cis) > 1 and max(lo for lo, _ in cis) > min(hi for _, hi in cis):
        shown = ", ".join(f"{m:.2f}x [{lo:.2f}–{hi:.2f}]" for m, (lo, hi) in
                          zip(run["speedup_runs"], run["speedup_runs_ci95"], strict=True) if m is not None)
        out.append(f"{label}: repeats disagree beyond their 95 % intervals ({shown}): the machine's load changed "
                   "during the run; rerun on a quiet machine")
    if drift is not None and drift[0] > BASELINE_DRIFT:
        out.append(f"{run['dataset']} · R={run['concurrency']}: plain decoding's speed moved by {100 * drift[0]:.0f} % "
                   f"during the run ({drift[1]:.0f}–{drift[2]:.0f} tokens/s): another process is competing for this "
                   "machine; stop it and rerun (speedups are paired, but their intervals widen)")
    other = run.get("other_cpu_cores")
    if other is not None and other > OTHER_CPU_CORES:
        out.append(f"{run['dataset']} · R={run['concurrency']}: other processes kept {other:.1f} CPU cores busy "
                   f"during the run (of {os.cpu_count()}): every tokens/s is below this machine's and the "
                   "intervals widen (speedups are paired, so a steady load leaves them standing); stop them "
                   "and rerun for absolute numbers")
    return out


def format_speedup(run: dict) -> str:
    """The speedup cell: "1.03x", with its 95 % interval "1.03x [0.95–1.08]" where the run has one."""
    if run.get("speedup") is None:
        return "-"
    ci = run.get("speedup_ci95")
    return f"{run['speedup']:.2f}x" + (f" [{ci[0]:.2f}–{ci[1]:.2f}]" if ci else "")


def drafted_share(run: dict) -> float | None:
    """Share of rounds that drafted, over every repeat when the report lists them."""
    runs = run.get("drafted_round_share_runs")
    return sum(runs) / len(runs) if runs else run.get("drafted_round_share")


def fitting_prompts(target: Target, prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int,
                    *, strict: bool = False, where: str = "prompts") -> tuple[list, int]:
    """The prompt ids that fit the target's context with ``max_new_tokens`` (and a verify block)
    after them, and how many did not. None fitting, or any not fitting with ``strict``, is an error."""
    max_ctx = target.max_context
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


def render_prompts(target: Target, prompts: Sequence[Prompt], chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """Token ids of each prompt (chat template applied with ``chat_template_kwargs``); a prompt the
    tokenizer fails on is an error naming its file and line."""
    ids = []
    for p in prompts:
        try:
            ids.append(target.render_prompt(p.text, chat_template_kwargs))
        except (TypeError, ValueError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DspecError(f"{p.where}: the target's tokenizer cannot encode this prompt ({reason})") from None
    return ids


def run_bench(opts: BenchOptions, progress: Callable[[str, int], Callable] | None = None,
              clock: Callable[[], float] = time.perf_counter, meter: Callable[[], CpuMeter] = CpuMeter) -> dict:
    """Run every (dataset, drafter, concurrency) and the plain-decoding baseline, paired unit by
    unit (:func:`run_paired`); return the JSON dict.

    ``progress(description, total)`` returns a per-request callback (for progress bars); ``clock``
    times the runs and ``meter`` measures other processes' CPU use during them (tests give
    synthetic ones).
    """
    check_block_size(opts.block_size)
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
    settings = GenerationConfig(**opts.sampling(), max_new_tokens=opts.max_new_tokens, block_size=opts.block_size,
                                batch_invariant=opts.batch_invariant, **rules)  # the other run options checked up front
    resolve_device(opts.device)
    parse_dtype(opts.dtype)
    datasets = list(opts.datasets) or [BUILTIN]
    prompt_sets = {d: load_prompts(d, opts.num_prompts) for d in datasets}
    # checkpoints (local or downloaded) before the target loads: a missing one fails first
    checkpoints = [str(resolve_checkpoint(c)) if c else None for c in opts.checkpoints] or [None] * len(opts.drafters)
    opts = dataclasses.replace(opts, target=choose_target(opts.target, checkpoints))  # no --target: the recorded one
    target = Target.load(opts.target, dtype=opts.dtype, device=opts.device)
    settings.batch_invariance(target)  # asked for where it cannot apply: an error before the drafters load
    bound_table = CostTable.load(opts.cost_table, block_size=opts.block_size) if opts.cost_table else None
    schedulers = [_schedulers(opts, target) for _ in opts.drafters]  # per drafter: the draft gate learns its cost
    drafters = [load_drafter(name, target, ckpt, opts.block_size) for name, ckpt in zip(opts.drafters, checkpoints, strict=True)]
    for name, drafter in zip(opts.drafters, drafters, strict=True):
        warn_if_other_kwargs(drafter, opts.chat_template_kwargs, target.tokenizer, name)
    runs = []
    for dset, prompts in prompt_sets.items():
        rendered = render_prompts(target, prompts, opts.chat_template_kwargs)
        ids, skipped = fitting_prompts(target, rendered, opts.max_new_tokens, opts.block_size, strict=opts.strict,
                                       where=f"--dataset {dset}")
        for conc in opts.concurrency:
            cfg = GenerationConfig(
                **opts.sampling(), max_new_tokens=opts.max_new_tokens, block_size=opts.block_size, max_batch=conc,
                graphs=opts.graphs(), batch_invariant=opts.batch_invariant, **rules,
            )
            engines = [("baseline", "-", SpeculativeEngine(target, None, cfg))]
            engines += [
                (name, sname, SpeculativeEngine(target, d, cfg, scheduler=sched))
                for name, d, scheds in zip(opts.drafters, drafters, schedulers, strict=True)
                for sname, sched in scheds
            ]
            if opts.warmup:
                warm_up(engines, ids[:conc])
            units = prompt_units(ids, opts.seed, conc)
            on_finish = None
            if progress:
                label = " + ".join(dict.fromkeys(n for n, _, _ in engines)) + f" · R={conc}"
                label += f" · {opts.repeats} repeats" if opts.repeats > 1 else ""
                on_finish = progress(f"{dataset_name(dset)} · {label}", len(ids) * len(engines) * opts.repeats)
            with meter() as load:
                timed = run_paired(engines, units, opts.repeats, on_finish, clock)
            drift = baseline_drift(timed[0])
            for (name, sname, _), spec in zip(engines[1:], timed[1:], strict=True):
                run = {
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
                    "batch_invariant": engines[0][2].batch_invariant,
                    **verify_report(total_stats([t for unit in spec for t in unit]).verify_rules, cfg),
                    **paired_metrics(spec, timed[0], opts.block_size, bound_table, conc),
                    "baseline_drift": drift[0] if drift else None,
                    "other_cpu_cores": load.other_cores,
                }
                if run["verify"] not in CHAIN_RULES:  # tree rounds: no chain survival to predict from
                    run.update({k: None for k in ("predicted_tau", "verifying_tau", "verifying_predicted_tau")})
                runs.append({**run, "warnings": run_warnings(run, drift) + unapplied_verify(opts.verify, run)})
    return {
        "target": opts.target or "embedded:tiny-target",
        "chat_template_kwargs": opts.chat_template_kwargs,
        "env": environment(target),
        "graphs": opts.graphs(),
        "runs": runs,
    }

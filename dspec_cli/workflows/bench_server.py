"""``dspec bench --server URL --baseline-server URL``: a serving engine measured the way ``dspec
bench`` measures dspec's own, against the same target served without speculation.

The prompts are rendered here (the target's chat template) and sent as token ids to both servers,
unit by unit as ``dspec bench`` pairs them (every unit of R concurrent requests runs on both
servers before the next; the order rotates; each request keeps its seed). Each row reports:

* τ and acceptance by position from the engine's own counters (:mod:`~dspec_cli.workflows.served`);
* tokens/s of both servers, per-request latency, and the paired speedup (median of the per-unit
  ratios with its 95 % interval);
* losslessness: every served request is scored by the target itself (teacher-forced, float32 by
  default), and the mean log-likelihood per token of the speculative server's outputs is compared,
  prompt by prompt, with the baseline's. A lossless engine samples what plain decoding samples, so
  the difference is zero up to sampling noise; the row is flagged (``lossless: false`` and a
  warning) when it exceeds ``LOSSLESS_Z`` standard errors of the paired differences, or
  ``LOSSLESS_FLOOR`` nats when the spread is tiny (greedy runs that agree). At T = 0 the share of
  requests token-identical to the baseline's is reported too.

Before anything is timed, both servers are checked: reachable, serving one model (or
``--server-model``), tokenizing like the target (a probe text's ``usage.prompt_tokens``), the
baseline serving the target's weights (its greedy tokens on the first prompt are the target's
argmax up to near-ties), the speculative server exposing spec-decode metrics and the baseline
drafting nothing. Any failure is a one-line error before a file is written.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
import torch

from dspec_cli.core.chat_template import default_kwargs
from dspec_cli.core.data import BUILTIN, dataset_name, load_prompts
from dspec_cli.core.errors import DspecError
from dspec_cli.core.http import PROBE, base_url
from dspec_cli.core.sampling import SamplingConfig
from dspec_cli.runtime.target import Target
from dspec_cli.workflows.bench import (
    environment,
    fitting_prompts,
    prompt_units,
    render_prompts,
)
from dspec_cli.workflows.metrics import median_ci95
from dspec_cli.workflows.served import Completion, Endpoint, SpecCounters

LOSSLESS_Z = 4.0  # standard errors of the paired log-likelihood differences a lossless engine stays within
LOSSLESS_FLOOR = 0.05  # nats per token: the tolerance never drops below this
MIN_PAIRS = 4  # fewer paired requests: no verdict
TARGET_PROBE_TOKENS = 8  # greedy tokens of the baseline checked against the target
NEAR_TIE = 0.1  # nats: a served greedy token this close to the target's argmax still counts as the argmax


@dataclass(frozen=True, kw_only=True)
class ServerBenchOptions(SamplingConfig):
    """What ``dspec bench --server`` was asked for: sampling (the inherited fields) and the rest."""

    server: str
    baseline_server: str
    target: str | None = None
    model: str | None = None  # the model name to request (default: the one each server lists)
    datasets: Sequence[str] = ()
    num_prompts: int | None = None
    max_new_tokens: int = 64
    concurrency: Sequence[int] = (1,)
    repeats: int = 1
    chat_template_kwargs: dict = field(default_factory=default_kwargs)
    device: str = "auto"
    dtype: str = "float32"  # the target that scores the served tokens
    timeout: float = 600.0


@torch.no_grad()
def plain_logits(target: Target, ids: Sequence[int]) -> torch.Tensor:
    """The target's float logits [L, V] over ``ids`` in one plain forward (no cache, the model's own
    masks): the reference a served engine's tokens are scored against."""
    return target.model(input_ids=torch.tensor([list(ids)], device=target.device), use_cache=False).logits[0].float()


@torch.no_grad()
def served_loglik(target: Target, prompt: Sequence[int], tokens: Sequence[int]) -> float:
    """Mean log-probability per token of ``tokens`` after ``prompt`` under the target at T = 1
    (teacher-forced, float logits)."""
    logits = plain_logits(target, list(prompt) + list(tokens))  # [L, V]
    logp = torch.log_softmax(logits[len(prompt) - 1: -1], -1)  # [n, V]: position i predicts tokens[i]
    return float(logp.gather(-1, torch.tensor(list(tokens), device=logp.device)[:, None]).mean())


def lossless_check(spec: Sequence[float], base: Sequence[float]) -> dict:
    """Paired comparison of per-request mean log-likelihoods (speculative vs baseline, same prompts):
    the mean difference, its standard error, the tolerance and the verdict (None below MIN_PAIRS)."""
    diffs = [s - b for s, b in zip(spec, base, strict=True)]
    n = len(diffs)
    mean = statistics.fmean(diffs) if diffs else 0.0
    se = statistics.stdev(diffs) / math.sqrt(n) if n > 1 else math.inf
    tol = max(LOSSLESS_Z * se, LOSSLESS_FLOOR)
    return {
        "loglik": statistics.fmean(spec) if spec else None,
        "baseline_loglik": statistics.fmean(base) if base else None,
        "loglik_delta": mean,
        "loglik_delta_se": se if math.isfinite(se) else None,
        "loglik_tolerance": tol if math.isfinite(tol) else None,
        "lossless": abs(mean) <= tol if n >= MIN_PAIRS else None,
    }


def tokenizer(target: Target):
    if target.tokenizer is None:
        raise DspecError("--target has no tokenizer: the served tokens cannot be checked against it")
    return target.tokenizer


async def check_servers(spec: Endpoint, base: Endpoint, target: Target, first: list[int], opts: ServerBenchOptions) -> None:
    """Everything that must hold before timing (module docstring); one-line DspecErrors."""
    for ep in (spec, base):
        await ep.connect(opts.model)
        served = await ep.prompt_tokens(PROBE)
        ours = len(tokenizer(target)(PROBE)["input_ids"])
        if served is not None and served != ours:
            raise DspecError(f"{ep.where} serves another tokenizer than --target {opts.target or 'embedded'!r}: a probe "
                             f"text is {served} tokens there, {ours} here")
        if ep.max_model_len and len(first) + opts.max_new_tokens > ep.max_model_len:
            raise DspecError(f"{ep.where}: its context of {ep.max_model_len} tokens cannot hold a prompt with "
                             f"--max-new-tokens {opts.max_new_tokens}")
    if not (await spec.metrics()).speculating:
        raise DspecError(f"{spec.where} exposes no speculative-decoding metrics: it serves without speculation "
                         "(start it with the command in the export's SERVE.md)")
    greedy = await base.complete(first, {"max_tokens": TARGET_PROBE_TOKENS, "temperature": 0.0}, 0)
    logits = plain_logits(target, first + greedy.tokens[:-1])  # [L, V]
    rows = torch.log_softmax(logits[len(first) - 1:], -1)  # [n, V]
    for k, tok in enumerate(greedy.tokens):
        if rows[k, tok] < rows[k].max() - NEAR_TIE:
            raise DspecError(f"{base.where} serves another model than --target {opts.target or 'embedded'!r}: its "
                             f"greedy token {k + 1} on the first prompt is not the target's")


@dataclass
class Unit:
    """One server's run over one unit of prompts."""

    results: list[Completion]
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)


async def run_paired(endpoints: Sequence[Endpoint], units, repeats: int, sampling: dict, tokenize,
                     clock: Callable[[], float], tick: Callable[[int], None]) -> list[list[list[Unit]]]:
    """``dspec bench``'s pairing (:func:`dspec_cli.workflows.bench.run_paired`) over servers: every
    server runs a unit (its R requests concurrently) before any server starts the next; the order
    rotates. Returns timed[server][repeat][unit]."""
    n = len(endpoints)
    timed: list[list[list[Unit]]] = [[[] for _ in range(repeats)] for _ in endpoints]
    for rep in range(repeats):
        for u, (ids, seeds) in enumerate(units):
            for i in [(u + rep + j) % n for j in range(n)]:
                t0 = clock()
                results = await asyncio.gather(*(endpoints[i].complete(list(p), sampling, s, tokenize)
                                                 for p, s in zip(ids, seeds, strict=True)))
                timed[i][rep].append(Unit(list(results), clock() - t0))
                tick(len(ids))
    return timed


def speed_metrics(spec: Sequence[Sequence[Unit]], base: Sequence[Sequence[Unit]]) -> dict:
    """Tokens/s (median over repeats), per-request latency and the paired speedup of ``spec``
    against ``base`` (timed[repeat][unit] each)."""
    tps = lambda units: sum(u.tokens for u in units) / max(1e-12, sum(u.seconds for u in units))  # noqa: E731
    ratios = [tps([s]) / tps([b]) for sr, br in zip(spec, base, strict=True)
              for s, b in zip(sr, br, strict=True) if s.tokens and b.tokens]
    latency = lambda runs: sorted(r.seconds for units in runs for u in units for r in u.results)  # noqa: E731
    spec_lat, base_lat = latency(spec), latency(base)
    interval = median_ci95(ratios)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None  # noqa: E731
    per_user = [len(r.tokens) / r.seconds for u in spec[0] for r in u.results if r.seconds > 0]
    return {
        "generated_tokens": sum(u.tokens for u in spec[0]),
        "repeats": len(spec),
        "pairs": len(ratios),
        "wall_seconds": sum(u.seconds for u in spec[0]),
        "tokens_per_s": statistics.median(tps(units) for units in spec),
        "tokens_per_s_runs": [tps(units) for units in spec],
        "per_user_tokens_per_s": statistics.fmean(per_user) if per_user else None,
        "baseline_tokens_per_s": statistics.median(tps(units) for units in base),
        "baseline_tokens_per_s_runs": [tps(units) for units in base],
        "speedup": statistics.median(ratios) if ratios else None,
        "speedup_ci95": list(interval) if interval else None,
        "latency_s": {"mean": statistics.fmean(spec_lat), "p50": pct(spec_lat, 0.5), "p90": pct(spec_lat, 0.9)},
        "baseline_latency_s": {"mean": statistics.fmean(base_lat), "p50": pct(base_lat, 0.5), "p90": pct(base_lat, 0.9)},
    }


def quality_metrics(target: Target, prompts: Sequence[Sequence[int]], spec: Sequence[Unit],
                    base: Sequence[Unit]) -> dict:
    """Losslessness of the first repeat's outputs (:func:`lossless_check`) and the share of requests
    token-identical to the baseline's."""
    spec_out = [r.tokens for u in spec for r in u.results]
    base_out = [r.tokens for u in base for r in u.results]
    spec_ll = [served_loglik(target, p, t) for p, t in zip(prompts, spec_out, strict=True)]
    base_ll = [served_loglik(target, p, t) for p, t in zip(prompts, base_out, strict=True)]
    same = sum(a == b for a, b in zip(spec_out, base_out, strict=True))
    return {**lossless_check(spec_ll, base_ll), "identical_share": same / len(spec_out) if spec_out else None}


def served_run(spec: Endpoint, base: Endpoint, counters: SpecCounters, speed: dict, quality: dict, common: dict) -> dict:
    """One row of the report: ``dspec bench``'s fields where they apply (``-`` / null elsewhere)."""
    acc = counters.acceptance()
    mean_verified = acc.pop("mean_verified")
    run = {
        "drafter": "server", "engine": spec.name, "server": spec.url, "baseline_server": base.url,
        "baseline_engine": base.name, "model": spec.model, "scheduler": "-", "verify": "-", **common,
        "block_size": round(mean_verified) if mean_verified else None, **acc,
        "mean_verify_budget": mean_verified + 1 if mean_verified else None,
        "draft_time_share": None, "drafted_round_share": None, "speedup_bound": None, **speed, **quality,
    }
    run["warnings"] = served_warnings(run, spec, counters)
    return run


def served_warnings(run: dict, spec: Endpoint, counters: SpecCounters) -> list[str]:
    label = f"{run['dataset']} · {run['engine']} at {run['server']} · R={run['concurrency']}"
    out = []
    if run["lossless"] is False:
        out.append(f"{label}: NOT LOSSLESS: the served tokens' mean log-likelihood under the target is "
                   f"{run['loglik']:.2f} nats/token against {run['baseline_loglik']:.2f} for plain decoding "
                   f"(difference {run['loglik_delta']:+.2f}, tolerance ±{run['loglik_tolerance']:.2f}): this engine "
                   "does not sample what the target samples at these settings")
    if counters.drafts <= 0 and counters.accept_length is not None:
        out.append(f"{label}: τ is SGLang's spec_accept_length gauge after the run (its latest logging interval), "
                   "not a count over the run; acceptance by position is not exposed")
    out += [f"{label}: {note}" for note in dict.fromkeys(spec.notes)]
    return out


async def bench_servers(opts: ServerBenchOptions, target: Target, prompt_ids: dict[str, tuple[list, int]],
                        clock: Callable[[], float], tick_for: Callable[[str, int], Callable[[int], None]],
                        transport: httpx.AsyncBaseTransport | None) -> tuple[list[dict], list[dict]]:
    """Check both servers, then run every (dataset, concurrency); returns (runs, server records)."""
    async with httpx.AsyncClient(timeout=opts.timeout, transport=transport) as http:
        spec = Endpoint(opts.server, "--server", http)
        base = Endpoint(opts.baseline_server, "--baseline-server", http)
        first = next(iter(prompt_ids.values()))[0][0]
        await check_servers(spec, base, target, first, opts)
        sampling = {"max_tokens": opts.max_new_tokens, "temperature": opts.temperature, "top_p": opts.top_p,
                    **({"top_k": opts.top_k} if opts.top_k > 0 else {})}

        def tokenize(text: str) -> list[int]:
            spec.notes.append("the engine returns no token ids: its text was tokenized here (may differ from the "
                              "ids it generated)")
            return tokenizer(target)(text, add_special_tokens=False)["input_ids"]

        await spec.complete(first, {**sampling, "max_tokens": min(8, opts.max_new_tokens)}, 0, tokenize)  # warm-up
        runs = []
        for dset, (ids, skipped) in prompt_ids.items():
            for conc in opts.concurrency:
                units = prompt_units(ids, opts.seed, conc)
                tick = tick_for(f"{dataset_name(dset)} · {spec.name} server vs baseline · R={conc}",
                                2 * len(ids) * opts.repeats)
                before, base_before = await spec.metrics(), await _maybe_metrics(base)
                timed = await run_paired([base, spec], units, opts.repeats, sampling, tokenize, clock, tick)
                counters, base_after = await spec.metrics() - before, await _maybe_metrics(base)
                _check_drafting(spec, base, counters, base_before, base_after, len(ids) * opts.repeats)
                common = {"dataset": dataset_name(dset), "concurrency": conc, "num_prompts": len(ids),
                          "skipped_prompts": skipped, "max_new_tokens": opts.max_new_tokens,
                          "temperature": opts.temperature, "top_p": opts.top_p, "top_k": opts.top_k}
                quality = quality_metrics(target, ids, timed[1][0], timed[0][0])
                runs.append(served_run(spec, base, counters, speed_metrics(timed[1], timed[0]), quality, common))
        servers = [{"option": ep.option, "url": ep.url, "engine": ep.engine, "version": ep.version, "model": ep.model}
                   for ep in (spec, base)]
        return runs, servers


async def _maybe_metrics(ep: Endpoint) -> SpecCounters | None:
    try:
        return await ep.metrics()
    except DspecError:
        return None  # a baseline without /metrics: its not drafting cannot be checked


def _check_drafting(spec: Endpoint, base: Endpoint, counters: SpecCounters, base_before: SpecCounters | None,
                    base_after: SpecCounters | None, requests: int) -> None:
    if counters.drafts <= 0 and counters.accept_length is None:
        raise DspecError(f"{spec.where} drafted nothing in {requests} requests (its spec-decode counters did not move): "
                         "it serves without speculation, or its drafter never proposes on these prompts")
    if base_before is not None and base_after is not None and (base_after - base_before).drafts > 0:
        raise DspecError(f"{base.where} speculates (its spec-decode counters moved): the baseline must serve the same "
                         "target without speculation")


def check_options(opts: ServerBenchOptions) -> None:
    base_url(opts.server, "--server")
    base_url(opts.baseline_server, "--baseline-server")
    if opts.max_new_tokens < 1:
        raise DspecError(f"--max-new-tokens must be >= 1, got {opts.max_new_tokens}")
    if opts.repeats < 1 or any(c < 1 for c in opts.concurrency):
        raise DspecError("--repeats and --concurrency values must be >= 1")


def run_server_bench(opts: ServerBenchOptions, progress: Callable[[str, int], Callable] | None = None,
                     clock: Callable[[], float] = time.perf_counter,
                     transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """Benchmark ``opts.server`` against ``opts.baseline_server`` (module docstring); the JSON dict
    of ``dspec bench`` with one row per (dataset, concurrency). ``progress(description, total)``
    returns a per-request callback; ``transport`` is an httpx transport (tests)."""
    check_options(opts)
    prompt_sets = {d: load_prompts(d, opts.num_prompts) for d in (list(opts.datasets) or [BUILTIN])}
    target = Target.load(opts.target, dtype=opts.dtype, device=opts.device)
    prompt_ids = {}
    for dset, prompts in prompt_sets.items():
        rendered = render_prompts(target, prompts, opts.chat_template_kwargs)
        prompt_ids[dset] = fitting_prompts(target, rendered, opts.max_new_tokens, 0, where=f"--dataset {dset}")

    def tick_for(desc: str, total: int) -> Callable[[int], None]:
        if progress is None:
            return lambda _n: None
        advance = progress(desc, total)

        def tick(requests: int) -> None:
            for _ in range(requests):
                advance(None)

        return tick

    runs, servers = asyncio.run(bench_servers(opts, target, prompt_ids, clock, tick_for, transport))
    return {"target": opts.target or "embedded:tiny-target", "chat_template_kwargs": opts.chat_template_kwargs,
            "env": {**environment(target), "servers": servers}, "runs": runs}


def merge(dspec: dict | None, served: dict) -> dict:
    """One report of dspec's own runs (``dspec bench --drafter``, None without) and the served ones:
    dspec's rows first, each row naming its engine."""
    if dspec is None:
        return served
    runs = [{**run, "engine": "dspec"} for run in dspec["runs"]] + served["runs"]
    return {**dspec, "env": {**dspec["env"], "servers": served["env"]["servers"]}, "runs": runs}

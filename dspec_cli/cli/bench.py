"""``dspec bench``: benchmark drafters against plain decoding of the same target."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from dspec_cli.cli import app
from dspec_cli.cli import options as opt
from dspec_cli.cli.progress import CommandProgress, results_console
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import CHECKPOINT_READS
from dspec_cli.core.outputs import is_stdout, write_json
from dspec_cli.core.run_paths import RunPaths

PLOTS = ("acceptance.png", "load.png", "load-*.png")


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def _prompts(run: dict) -> str:
    """Prompts run, and how many were skipped for not fitting the context."""
    skipped = run.get("skipped_prompts", 0)
    return f"{run['num_prompts']}" + (f" ({skipped} skipped)" if skipped else "")


def _bound(run: dict) -> str:
    """The speedup the measured τ allows with free drafting and host work (reports from before it: -)."""
    bound = run.get("speedup_bound")
    return "-" if bound is None else f"{bound:.2f}x"


def _served(run: dict) -> list[str]:
    """The columns of a served engine's row (``bench --server``): engine, log-likelihood difference
    against the baseline's and the verdict."""
    lossless = {True: "yes", False: "NO", None: "-"}[run.get("lossless")]
    return [run.get("engine", "dspec"), _fmt(run.get("loglik_delta"), "+.2f"), lossless]


def render_table(report: dict, console: Console) -> None:
    from dspec_cli.workflows.bench import drafted_share, format_speedup

    served = any("engine" in run for run in report["runs"])
    table = Table(title=f"dspec bench · target {report['target']} · {report['env']['device']} · {report['env']['dtype']}")
    columns = ["dataset", "prompts", "drafter", "scheduler", "verify", "R", "τ", "pred. τ", "tok/s", "per user", "base tok/s", "speedup", "bound", "budget", "cond. accept by position", "draft %", "drafted"]
    for col in columns + (["engine", "loglik Δ", "lossless"] if served else []):
        left = col in ("dataset", "drafter", "scheduler", "verify", "cond. accept by position", "engine")
        table.add_column(col, justify="left" if left else "right", no_wrap=col in ("dataset", "drafter", "scheduler", "engine"))
    for run in report["runs"]:
        cond = " ".join(_fmt(c, ".2f") for c in run["cond_accept"])
        share = run.get("draft_time_share")
        table.add_row(
            run["dataset"], _prompts(run), run["drafter"], run["scheduler"], run.get("verify", "-"),
            str(run["concurrency"]), _fmt(run["tau"]), _fmt(run.get("predicted_tau")),
            _fmt(run["tokens_per_s"], ".1f"), _fmt(run["per_user_tokens_per_s"], ".1f"),
            _fmt(run["baseline_tokens_per_s"], ".1f"), format_speedup(run), _bound(run), _fmt(run["mean_verify_budget"]), cond,
            _fmt(None if share is None else 100 * share, ".0f"), _percent(drafted_share(run)),
            *(_served(run) if served else []),
        )
    console.print(table)


def render_domains(rows: list[dict], console: Console) -> None:
    table = Table(title="τ per domain (mean over the sets of each domain)")
    for col in ("drafter", "scheduler", "R", "math", "code", "chat"):
        table.add_column(col, justify="left" if col in ("drafter", "scheduler") else "right")
    for r in rows:
        table.add_row(r["drafter"], r["scheduler"], str(r["concurrency"]), _fmt(r["math"]), _fmt(r["code"]), _fmt(r["chat"]))
    console.print(table)


@app.command("bench")
def bench_command(
    ctx: typer.Context,
    drafter: list[str] = typer.Option([], "--drafter", "-d", help="Drafter (repeatable): NAME[:BASE][,KEY=VALUE...] with config options, e.g. ddtree:dspark,tree_budget=64 (see `dspec drafters`)."),
    target: Optional[str] = opt.target(),
    checkpoint: list[str] = typer.Option([], "--checkpoint", metavar="PATH|HUB_ID", help="Drafter checkpoint, one per --drafter in order ('' for a drafter's default)."),
    dataset: list[str] = opt.dataset(),
    num_prompts: Optional[int] = opt.num_prompts(),
    max_new_tokens: int = opt.max_new_tokens(64),
    temperature: float = opt.temperature(),
    top_p: float = opt.top_p(),
    top_k: int = opt.top_k(),
    block_size: int = opt.block_size(7, "γ: most draft tokens verified per round (>= 1, at most the drafter's trained block)."),
    seed: int = opt.seed(),
    repeats: int = opt.int_option(1, "--repeats", minimum=1, help="Passes over the prompts (>= 1); each prompt runs with plain decoding next to it, speedup is the median of the paired ratios with a 95 % interval."),
    concurrency: str = opt.concurrency_list("1"),
    scheduler: list[str] = typer.Option(["fixed"], "--scheduler", "-s", help="Verification-length scheduler (repeatable): NAME[,KEY=VALUE...]: fixed, threshold[,threshold=0.6], hardware[,gate=false,layout=packed], async, or a plugin's."),
    cost_table: Optional[Path] = typer.Option(None, "--cost-table", metavar="FILE", help="Cost table from `dspec profile-hardware --json`, or an SGLang DSpark SPS table (needed by hardware/async)."),
    strict: bool = opt.strict("a cost table from another device or model, or a prompt that does not fit the context,"),
    device: str = opt.device(),
    dtype: str = opt.dtype(),
    cuda_graphs: bool = opt.cuda_graphs(),
    compile_rounds: bool = opt.compile_rounds(),
    batch_invariant: Optional[bool] = opt.batch_invariant(),
    json_path: Optional[Path] = opt.json_path("the full report"),
    plots: Optional[Path] = opt.plots("acceptance.png; with several concurrencies also load.png"),
    chat_template_kwargs: Optional[str] = opt.chat_template_kwargs(),
    suite: Optional[str] = typer.Option(None, "--suite", help="paper = the paper's nine evaluation sets with their caps (see `dspec datasets`); prints τ per domain."),
    verify: list[str] = typer.Option([], "--verify", help="Verification rule (repeatable): token or block for chains with draft probabilities (default block), sampled or traversal for trees of sampled siblings (default sampled). See docs/verification.md."),
    server: Optional[str] = typer.Option(None, "--server", metavar="URL", help="An OpenAI-compatible server of the target with speculation (vLLM, SGLang): measured like dspec's engine against --baseline-server, τ from its metrics endpoint, served tokens scored by the target (docs/bench.md)."),
    baseline_server: Optional[str] = typer.Option(None, "--baseline-server", metavar="URL", help="The same target served without speculation (needed with --server)."),
    server_model: Optional[str] = typer.Option(None, "--server-model", help="The model name to request from the servers (default: the one each lists)."),
) -> None:
    """Measure τ, acceptance by position and speedup over plain decoding of the same target."""
    from dspec_cli.workflows.bench import BenchOptions, run_bench

    if server is None:
        opt.refuse(ctx, ("server_model",), "without --server", "with --server")
    elif not drafter:
        opt.refuse(ctx, ("checkpoint", "scheduler", "block_size", "cost_table", "verify", "cuda_graphs", "compile_rounds",
                   "batch_invariant"),
                   "without --drafter", "to dspec's engine (--drafter)")
    if baseline_server is not None and server is None:
        raise DspecError("--baseline-server is the baseline of --server; give --server too")
    if server is not None and baseline_server is None:
        raise DspecError("--server needs --baseline-server: the same target served without speculation")
    if not drafter and server is None:
        raise DspecError("give --drafter (dspec's engine) or --server with --baseline-server (a served engine)")
    if suite is not None:
        from dspec_cli.core.datasets import PAPER_SUITE

        if suite != "paper":
            raise DspecError(f"--suite must be 'paper', got {suite!r}")
        dataset = [*PAPER_SUITE, *dataset]
    RunPaths().read("--dataset", *dataset).read("--checkpoint", *checkpoint, names=CHECKPOINT_READS) \
        .read("--target", target).read("--cost-table", cost_table) \
        .write("--json", json_path, stream=True).write_folder("--plots", plots, files=PLOTS).check()
    opts = BenchOptions(
        drafters=drafter, target=target, checkpoints=checkpoint, datasets=dataset, num_prompts=num_prompts,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, block_size=block_size,
        seed=seed, concurrency=opt.int_list(concurrency, "--concurrency", maximum=opt.MAX_CONCURRENCY), device=device, dtype=dtype,
        schedulers=scheduler, cost_table=str(cost_table) if cost_table else None, strict=strict, repeats=repeats,
        cuda_graphs=cuda_graphs, compile=compile_rounds, batch_invariant=batch_invariant,
        chat_template_kwargs=opt.template_kwargs(chat_template_kwargs),
        verify=verify,
    )
    sopts = None
    if server is not None and baseline_server is not None:
        from dspec_cli.workflows.bench_server import ServerBenchOptions, check_options

        sopts = ServerBenchOptions(
            server=server, baseline_server=baseline_server, target=target, model=server_model, datasets=dataset,
            num_prompts=num_prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, concurrency=opts.concurrency, repeats=repeats, device=device,
            chat_template_kwargs=opts.chat_template_kwargs)
        check_options(sopts)  # before dspec's own runs: a bad URL fails first
    err = Console(stderr=True)
    with CommandProgress(err, unit="requests") as bar:

        def progress(desc: str, total: int):
            task = bar.add_task(desc, total=total)
            return lambda _res: bar.advance(task)

        report = run_bench(opts, progress) if drafter else None
        if sopts is not None:
            from dspec_cli.workflows.bench_server import merge, run_server_bench

            report = merge(report, run_server_bench(sopts, progress))
    assert report is not None
    skipped = {r["dataset"]: r["skipped_prompts"] for r in report["runs"] if r.get("skipped_prompts")}
    for name, n in skipped.items():
        warnings.warn(f"{name}: skipped {n} prompt(s) that do not fit the target's context with --max-new-tokens "
                      f"{max_new_tokens} (--strict makes this an error)", stacklevel=1)
    for message in dict.fromkeys(w for r in report["runs"] for w in r.get("warnings", ())):
        warnings.warn(message, stacklevel=1)
    if suite is not None:
        from dspec_cli.core.datasets import domain_tau

        report["domains"] = domain_tau(report["runs"])
    if not is_stdout(json_path):
        render_table(report, results_console())
        if suite is not None:
            render_domains(report["domains"], results_console())
    opt.wrote(err, write_json(json_path, report) if json_path is not None else None)
    if plots is not None and report["runs"]:
        from dspec_cli.workflows.plots import acceptance_plot, load_plots, report_title

        title = report_title(report)
        written = [acceptance_plot(report["runs"], plots / PLOTS[0], title)]
        if len(opts.concurrency) > 1:
            written += load_plots(report["runs"], plots, title)
        err.print("wrote " + ", ".join(str(p) for p in written), highlight=False, soft_wrap=True)

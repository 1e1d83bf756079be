"""``dspec data``: training data tools (``dspec data regenerate``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import MofNCompleteColumn, TextColumn, TimeRemainingColumn

from dspec_cli.cli import app
from dspec_cli.cli import options as opt
from dspec_cli.cli.progress import CommandProgress
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import CHECKPOINT_READS
from dspec_cli.core.outputs import is_stdout, write_json
from dspec_cli.core.run_paths import RunPaths

data_app = typer.Typer(help="Training data: regenerate responses with the target.", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("regenerate")
def regenerate_command(
    ctx: typer.Context,
    recipe: Optional[Path] = typer.Option(None, "--recipe", "-r", help="Take target, prompts, output and sampling from a training recipe."),
    target: Optional[str] = opt.target(default="the recipe's, else the one --checkpoint was trained for, else the embedded tiny target"),
    prompts: list[str] = opt.dataset("--prompts"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", metavar="FILE|-", help="Output jsonl ('-': stdout); re-running skips ids already there (nothing is overwritten)."),
    drafter: Optional[str] = typer.Option(None, "--drafter", "-d", help="Drafter that speeds generation up (output is lossless)."),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="Checkpoint of --drafter: folder or Hub id."),
    max_new_tokens: Optional[int] = opt.max_new_tokens(None, "Most tokens per assistant turn, >= 1 (default 4096)."),
    temperature: Optional[float] = opt.float_option(None, "--temperature", help="Sampling temperature, >= 0 (0 = greedy; default 0.7, Qwen3 non-thinking)."),
    top_p: Optional[float] = opt.float_option(None, "--top-p", help="Nucleus sampling mass in (0, 1] (default 0.8)."),
    top_k: Optional[int] = opt.top_k(None, "Sample from the K most likely tokens, >= 0 (0 = off; default 20)."),
    concurrency: Optional[int] = opt.concurrency(None, "Concurrent requests (default 32)."),
    limit: Optional[int] = opt.int_option(None, "--limit", minimum=1, help="Only the first N conversations."),
    seed: Optional[int] = opt.seed(None, "Random seed, 0 <= S < 2^32 (default the recipe's, else 0): the same seed gives the same tokens."),
    block_size: int = opt.block_size(7, "γ of --drafter (>= 1)."),
    device: str = opt.device(),
    dtype: str = opt.dtype(),
    batch_invariant: Optional[bool] = opt.batch_invariant(),
    json_path: Optional[Path] = opt.json_path("the counts (written, already done, shortened, truncated, skipped, tokens)"),
    server: list[str] = typer.Option([], "--server", help="OpenAI-compatible server URL (vllm serve, SGLang, TGI, transformers serve) instead of the built-in engine; repeatable: servers share the work."),
    server_concurrency: int = opt.int_option(32, "--server-concurrency", minimum=1, maximum=opt.MAX_CONCURRENCY, help="Conversations in flight per --server."),
    model: Optional[str] = typer.Option(None, "--model", help="Model name to request from the servers (default: the one /v1/models lists)."),
    chat_template_kwargs: Optional[str] = opt.chat_template_kwargs(recipe=True),
    max_retries: int = opt.int_option(5, "--max-retries", minimum=0, maximum=100, help="Retries per request on 429 / 5xx / timeouts (exponential back-off)."),
    request_timeout: float = opt.float_option(600.0, "--request-timeout", help="Seconds per server request."),
) -> None:
    """Regenerate every assistant turn with the target (self-distillation data for dspec train)."""
    from transformers.utils import logging as hf_logging

    from dspec_cli.training.regenerate import command_options, regenerate

    hf_logging.disable_progress_bar()
    if server:
        opt.refuse(ctx, ("drafter", "checkpoint", "concurrency", "block_size", "device", "dtype", "batch_invariant"),
                   "with --server", "to the built-in engine (with --server use --server-concurrency)")
    else:
        opt.refuse(ctx, ("server_concurrency", "model", "max_retries", "request_timeout"), "without --server",
                   "with --server")
    opts = command_options(
        recipe=recipe, prompts=prompts, output=output, target=target, checkpoint=checkpoint,
        chat_template_kwargs=None if chat_template_kwargs is None else opt.template_kwargs(chat_template_kwargs),
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, concurrency=concurrency,
        limit=limit, seed=seed, drafter=drafter, block_size=block_size, device=device, dtype=dtype,
        batch_invariant=batch_invariant,
    )
    out = Path(opts.output)
    RunPaths().read("--dataset" if prompts else f"regenerate.prompts of --recipe {recipe}", *opts.prompts) \
        .read("--recipe", recipe).read("--checkpoint", checkpoint, names=CHECKPOINT_READS).read("--target", opts.target) \
        .write("--output" if output else f"data.path of --recipe {recipe}", out, stream=True) \
        .write("--json", json_path, stream=True).write("the errors file", _errors_file(out, server)).check()
    err = Console(stderr=True)
    if server:
        from dspec_cli.cli.regenerate_server import run_with_servers

        stats = run_with_servers(opts, server, server_concurrency, model, max_retries, request_timeout, console=err)
    else:
        with CommandProgress(err, MofNCompleteColumn(), TextColumn("turns"), TimeRemainingColumn(), unit="turns") as bar:

            def progress(desc: str, total: int):  # the bar starts once the inputs have been checked
                task = bar.add_task(desc, total=total)
                return lambda _res: bar.advance(task)

            stats = regenerate(opts, progress)
    for note in stats.notes:
        err.print(note)
    rate = stats.generated_tokens / stats.seconds if stats.seconds else 0.0
    conv_rate = stats.written / stats.seconds if stats.seconds else 0.0
    if json_path is not None:
        opt.wrote(err, write_json(json_path, {"output": str(out), **vars(stats), "tokens_per_s": rate,
                                              "conversations_per_s": conv_rate}))
        if is_stdout(json_path):
            return
    print(
        f"{out}: wrote {stats.written} conversation(s) ({stats.turns} turns, {stats.generated_tokens} tokens, "
        f"{conv_rate:.2f} conv/s, {rate:.0f} tok/s); {stats.already_done} already done, {stats.shortened} shortened "
        f"and {stats.skipped} skipped (context too short), {stats.truncated} truncated (an answer reached "
        f"--max-new-tokens)",
        file=sys.stderr if is_stdout(out) else sys.stdout,  # stdout holds the streamed output only
    )
    if stats.failed:
        errors = _errors_file(out, server)
        where = f"reasons in {errors}" if errors else "reasons in the warnings above"
        raise DspecError(f"{stats.failed} conversation(s) failed ({where}); re-run to retry them")


def _errors_file(out: Path, server: list[str]) -> Path | None:
    """Where the server path lists failed conversations (none for stdout or a special file)."""
    from dspec_cli.training.regenerate_server import errors_path

    return errors_path(out) if server else None  # None for stdout or a special file

"""``dspec data``: training data tools (``dspec data regenerate``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import MofNCompleteColumn, TextColumn, TimeRemainingColumn

from dspec_cli.cli import app
from dspec_cli.cli.progress import CommandProgress
from dspec_cli.core.errors import DspecError

data_app = typer.Typer(help="Training data: regenerate responses with the target.", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("regenerate")
def regenerate_command(
    recipe: Optional[Path] = typer.Option(None, "--recipe", "-r", help="Take target, prompts, output and sampling from a training recipe."),
    target: Optional[str] = typer.Option(None, "--target", help="Target model: local path or Hub id (default: the embedded tiny target)."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="jsonl of {\"turns\": [...]} or ShareGPT {\"conversations\": [...]} lines."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Output jsonl; re-running skips ids already there."),
    drafter: Optional[str] = typer.Option(None, "--drafter", "-d", help="Drafter that speeds generation up (output is lossless)."),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="Checkpoint of --drafter: folder or Hub id."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Per assistant turn (default 4096)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Default 0.7 (Qwen3 non-thinking)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Default 0.8."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Default 20."),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", help="Concurrent requests (default 32)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N conversations."),
    seed: Optional[int] = typer.Option(None, "--seed"),
    block_size: int = typer.Option(7, "--block-size", help="γ of --drafter."),
    device: str = typer.Option("auto", "--device", help="auto = cuda when available, else cpu."),
    dtype: str = typer.Option("auto", "--dtype"),
) -> None:
    """Regenerate every assistant turn with the target (self-distillation data for dspec train)."""
    from transformers.utils import logging as hf_logging

    from dspec_cli.core.files import EMBEDDED
    from dspec_cli.training.recipes import RegenerateSpec, load_recipe
    from dspec_cli.training.regenerate import RegenerateOptions, regenerate

    hf_logging.disable_progress_bar()
    spec, target_name, out = RegenerateSpec(), target, output
    if recipe is not None:
        rec = load_recipe(recipe)
        spec = rec.regenerate
        if target is not None and target != rec.target.name:
            raise DspecError(f"recipe {recipe} is for target {rec.target.name!r}, not {target!r}")
        target_name = None if rec.target.name == EMBEDDED else rec.target.name
        out = output or (Path(rec.data.paths[0]) if rec.data.paths else None)
    prompts = prompts or spec.prompts
    if not prompts or out is None:
        raise DspecError("give --prompts and --output (or a --recipe with regenerate.prompts and data.path)")
    pick = lambda flag, value: value if flag is None else flag  # noqa: E731
    opts = RegenerateOptions(
        prompts=prompts, output=out, target=target_name, drafter=drafter, checkpoint=checkpoint,
        max_new_tokens=pick(max_new_tokens, spec.max_new_tokens), temperature=pick(temperature, spec.temperature),
        top_p=pick(top_p, spec.top_p), top_k=pick(top_k, spec.top_k), concurrency=pick(concurrency, spec.concurrency),
        limit=pick(limit, spec.limit or None), seed=pick(seed, spec.seed), block_size=block_size, device=device,
        dtype=dtype,
    )
    err = Console(stderr=True)
    with CommandProgress(err, MofNCompleteColumn(), TextColumn("turns"), TimeRemainingColumn()) as bar:

        def progress(desc: str, total: int):  # the bar starts once the inputs have been checked
            task = bar.add_task(desc, total=total)
            return lambda _res: bar.advance(task)

        stats = regenerate(opts, progress)
    for note in stats.notes:
        err.print(note)
    rate = stats.generated_tokens / stats.seconds if stats.seconds else 0.0
    print(
        f"{out}: wrote {stats.written} conversation(s) ({stats.turns} turns, {stats.generated_tokens} tokens, "
        f"{rate:.0f} tok/s); {stats.already_done} already done, {stats.shortened} shortened and "
        f"{stats.skipped} skipped (context too short)"
    )

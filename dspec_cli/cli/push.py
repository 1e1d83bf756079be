"""``dspec push``: validate a drafter checkpoint and publish it to the Hugging Face Hub in one commit."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import DownloadColumn

from dspec_cli.cli import app
from dspec_cli.cli import options as opt
from dspec_cli.cli.progress import CommandProgress
from dspec_cli.core.files import CHECKPOINT_READS, PUBLISHED_FILES
from dspec_cli.core.outputs import is_stdout, write_json
from dspec_cli.core.run_paths import RunPaths


@app.command("push")
def push_command(
    checkpoint: Path = typer.Argument(..., help="Drafter checkpoint folder (config.json, model.safetensors, ...)."),
    repo_id: str = typer.Option(..., "--repo-id", help="Hub repository NS/NAME (created when missing)."),
    private: bool = typer.Option(False, "--private", help="Create the repository as private."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Branch to commit to (created from main when missing; default main)."),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="Hub URL (default: HF_ENDPOINT, else https://huggingface.co)."),
    token: Optional[str] = typer.Option(None, "--token", help="Hub token (default: HF_TOKEN, else the `hf auth login` token); never printed."),
    target: Optional[str] = typer.Option(None, "--target", metavar="PATH|HUB_ID", help="Validate against this target (default: the one config.json names)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and print what would be uploaded, then stop (nothing is sent)."),
    json_path: Optional[Path] = opt.json_path("the result (repo, revision, commit, files)"),
) -> None:
    """Check that CHECKPOINT loads against its target, refresh its model card, upload it in one commit."""
    from dspec_cli.checkpoints.hub import push_folder, push_repo_id
    from dspec_cli.checkpoints.model_card import refresh_model_card
    from dspec_cli.core.files import CARD_FILE
    from dspec_cli.core.version import __version__
    from dspec_cli.workflows.validate import validate_checkpoint

    push_repo_id(repo_id)  # a bad id fails before anything loads
    RunPaths().read("CHECKPOINT", checkpoint, names=(*CHECKPOINT_READS, *PUBLISHED_FILES)).read("--target", target) \
        .write("--json", json_path, stream=True).check()
    err = Console(stderr=True)
    with err.status(f"validating {checkpoint}"):
        config = validate_checkpoint(checkpoint, target)
    files = [name for name in PUBLISHED_FILES if name != CARD_FILE and (checkpoint / name).is_file()]
    card = refresh_model_card(checkpoint, config, repo_id)
    total = sum((checkpoint / name).stat().st_size for name in files) + len(card.encode())
    if dry_run:
        sizes = {**{name: (checkpoint / name).stat().st_size for name in files}, CARD_FILE: len(card.encode())}
        plan = {"repo_id": repo_id, "revision": revision or "main", "private": private, "files": sizes,
                "bytes": total, "dry_run": True}
        if json_path is not None:
            opt.wrote(err, write_json(json_path, plan))
        if not is_stdout(json_path):
            print(f"would commit {len(sizes)} files ({total:,} bytes) to {repo_id}@{revision or 'main'}"
                  + (" (private)" if private else "") + ":")
            for name, size in sizes.items():
                print(f"  {name}  {size:,} bytes" + ("  (refreshed model card)" if name == CARD_FILE else ""))
        return
    with CommandProgress(err, DownloadColumn()) as bar:
        task = bar.add_task(f"uploading to {repo_id}", total=total)
        result = push_folder(
            checkpoint, repo_id, files, card, private=private, revision=revision, endpoint=endpoint, token=token,
            message=f"Upload {config['drafter']} drafter (dspec {__version__})",
            on_file=lambda name, size: bar.update(task, advance=size, description=f"uploaded {name}"),
        )
    if json_path is not None:
        opt.wrote(err, write_json(json_path, vars(result)))
        if is_stdout(json_path):
            return
    err.print(f"committed {len(result.files)} files to {result.repo_id}@{result.revision}: {result.commit_url}",
              soft_wrap=True, highlight=False)
    print(result.url)

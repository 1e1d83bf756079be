"""``dspec export``: write a drafter checkpoint in the layout vLLM / SGLang read, print the serve command."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from dspec_cli.cli import app
from dspec_cli.cli import options as opt
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import CHECKPOINT_READS
from dspec_cli.core.outputs import is_stdout, write_json
from dspec_cli.core.run_paths import RunPaths


@app.command("export")
def export_command(
    checkpoint: str = typer.Argument(..., help="Drafter checkpoint: folder or Hub id (dspec's or a foreign layout)."),
    fmt: str = typer.Option(..., "--format", help="vllm or sglang (the layout each engine loads), or speculators (vllm-project/speculators' format, which vLLM serves too)."),
    output: Path = typer.Option(..., "--output", metavar="DIR", help="Folder for the engine's draft checkpoint (it holds that export only)."),
    target: Optional[str] = opt.target(),
    dtype: str = opt.dtype(),
    cost_table: Optional[Path] = typer.Option(None, "--cost-table", help="SGLang DSpark: cost table (dspec's or SGLang's) for dspark_sps.json (default: the checkpoint's cost_table.json)."),
    json_path: Optional[Path] = opt.json_path("the export report (layout, engine settings, command)"),
    chat_template_kwargs: Optional[str] = opt.chat_template_kwargs(),
    overwrite: bool = opt.overwrite("a non-empty --output folder (an earlier export) as a whole"),
) -> None:
    """Export a drafter for vLLM or SGLang and print the command that serves it."""
    from dspec_cli.checkpoints import load_drafter
    from dspec_cli.checkpoints.hub import resolve_checkpoint
    from dspec_cli.checkpoints.native import choose_target
    from dspec_cli.core.files import DEFAULT_TARGET_PATH
    from dspec_cli.runtime.target import Target
    from dspec_cli.workflows.export import FORMATS, export

    if fmt not in FORMATS:
        raise DspecError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    RunPaths().read("CHECKPOINT", checkpoint, names=CHECKPOINT_READS).read("--target", target) \
        .read("--cost-table", cost_table).write_folder("--output", output, overwrite=overwrite) \
        .write("--json", json_path, stream=True).check()
    template_kwargs = opt.template_kwargs(chat_template_kwargs)  # the deployment's; its server default
    path = resolve_checkpoint(checkpoint)
    target = choose_target(target, [path])  # no --target: the one the checkpoint was trained for
    tgt = Target.load(target, dtype=dtype)
    drafter = load_drafter(None, tgt, path)
    target_name = target or str(DEFAULT_TARGET_PATH)
    if Path(target_name).exists():
        target_name = str(Path(target_name).resolve())
    report = export(drafter, tgt, fmt, output, target_name, checkpoint=path, cost_table=cost_table,
                    chat_template_kwargs=template_kwargs)
    err = Console(stderr=True, soft_wrap=True)
    err.print(f"wrote {report['output']} ({report['layout']} layout, {fmt} method {report['method']})", highlight=False)
    for note in report["notes"]:
        err.print(f"note: {note}", highlight=False, markup=False)
    if not is_stdout(json_path):
        print(report["command"])
    if json_path is not None:
        opt.wrote(err, write_json(json_path, report))

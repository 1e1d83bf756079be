"""``dspec export``: write a drafter checkpoint in the layout vLLM / SGLang read, print the serve command."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from dspec_cli.cli import app
from dspec_cli.cli import options as opt
from dspec_cli.outputs import check_output_dir, check_output_file, is_stdout, write_json
from dspec_cli.errors import DspecError


@app.command("export")
def export_command(
    checkpoint: str = typer.Argument(..., help="Drafter checkpoint: folder or Hub id (dspec's or a foreign layout)."),
    fmt: str = typer.Option(..., "--format", help="Serving engine: vllm or sglang."),
    output: Path = typer.Option(..., "--output", help="Folder for the engine's draft checkpoint."),
    target: Optional[str] = opt.target(),
    dtype: str = opt.dtype(),
    json_path: Optional[Path] = opt.json_path("the export report (layout, engine settings, command)"),
) -> None:
    """Export a drafter for vLLM or SGLang and print the command that serves it."""
    from dspec_cli import interop, plugins
    from dspec_cli.hub import resolve_checkpoint
    from dspec_cli.interop.serving import FORMATS, export
    from dspec_cli.target import DEFAULT_TARGET_PATH, Target

    if fmt not in FORMATS:
        raise DspecError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    check_output_dir(output, "--output")
    check_output_file(json_path, "--json")
    path = resolve_checkpoint(checkpoint)
    if output.resolve() == path.resolve():
        raise DspecError("--output must differ from the checkpoint folder (export writes another layout)")
    cls = plugins.get_drafter_class(interop.checkpoint_drafter(path))
    tgt = Target.load(target, dtype=dtype)
    drafter = cls.from_pretrained(path, tgt)
    target_name = target or str(DEFAULT_TARGET_PATH)
    if Path(target_name).exists():
        target_name = str(Path(target_name).resolve())
    report = export(drafter, tgt, fmt, output, target_name)
    err = Console(stderr=True, soft_wrap=True)
    err.print(f"wrote {report['output']} ({report['layout']} layout, {fmt} method {report['method']})", highlight=False)
    if not is_stdout(json_path):
        print(report["command"])
    if json_path is not None:
        opt.wrote(err, write_json(json_path, report))

"""``dspec datasets``: the prompt and benchmark sets known by name."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from dspec_cli.cli import app
from dspec_cli.cli import options as opt
from dspec_cli.cli.progress import results_console
from dspec_cli.core.outputs import is_stdout, write_json
from dspec_cli.core.run_paths import RunPaths


@app.command("datasets")
def datasets_command(
    json_path: Optional[Path] = opt.json_path("the registry"),
) -> None:
    """List the sets that --dataset / --prompts accept by name (Hub id, revision, split, fields, template)."""
    from dspec_cli.core.datasets import describe

    RunPaths().write("--json", json_path, stream=True).check()
    rows = describe()
    if json_path is not None:
        opt.wrote(Console(stderr=True), write_json(json_path, {"datasets": rows}))
        if is_stdout(json_path):
            return
    table = Table(title="dspec datasets (use as --dataset NAME or --prompts NAME)")
    for col in ("name", "kind", "domain", "Hub dataset", "revision", "split", "fields", "cap", "template"):
        table.add_column(col, overflow="fold")
    for r in rows:
        revision = r["revision"][:12] if r["pinned"] else f"{r['revision']} (unpinned)"
        template = r["template"].replace("\n", "\\n")
        table.add_row(r["name"], r["kind"], r["domain"], r["repo_id"], revision, r["split"], ", ".join(r["fields"]),
                      "-" if r["cap"] is None else str(r["cap"]), template if len(template) < 60 else template[:57] + "...")
    results_console().print(table)

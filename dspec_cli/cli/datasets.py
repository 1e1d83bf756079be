"""``dspec datasets``: the prompt and benchmark sets known by name."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from dspec_cli.cli import app


@app.command("datasets")
def datasets_command(
    as_json: bool = typer.Option(False, "--json", help="Print the registry as JSON."),
) -> None:
    """List the sets that --dataset / --prompts accept by name (Hub id, revision, split, fields, template)."""
    from dspec_cli.core.datasets import describe

    rows = describe()
    if as_json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        return
    table = Table(title="dspec datasets (use as --dataset NAME or --prompts NAME)")
    for col in ("name", "kind", "domain", "Hub dataset", "revision", "split", "fields", "cap", "template"):
        table.add_column(col, overflow="fold")
    for r in rows:
        revision = r["revision"][:12] if r["pinned"] else f"{r['revision']} (unpinned)"
        template = r["template"].replace("\n", "\\n")
        table.add_row(r["name"], r["kind"], r["domain"], r["repo_id"], revision, r["split"], ", ".join(r["fields"]),
                      "-" if r["cap"] is None else str(r["cap"]), template if len(template) < 60 else template[:57] + "...")
    console = Console()
    (console if console.is_terminal else Console(width=200)).print(table)

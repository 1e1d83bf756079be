"""``dspec drafters``: list installed drafters (and schedulers) from every plugin."""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console
from rich.table import Table

from dspec_cli.cli import app
from dspec_cli.core import plugins


def drafter_rows(reg: plugins.Registry) -> list[dict]:
    rows = []
    for name, item in sorted(reg.drafters.items()):
        rows.append(
            {
                "name": name,
                "aliases": list(item.aliases),
                "capabilities": sorted(getattr(item.cls, "capabilities", ())),
                "description": getattr(item.cls, "description", ""),
                "plugin": item.plugin,
                "package": item.package,
                "version": item.version,
            }
        )
    return rows


@app.command("drafters")
def drafters_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON on stdout instead of a table."),
) -> None:
    """List the drafters registered by installed plugins."""
    reg = plugins.registry()
    rows = drafter_rows(reg)
    schedulers = [
        {"name": n, "plugin": s.plugin, "package": s.package, "version": s.version}
        for n, s in sorted(reg.schedulers.items())
    ]
    err = Console(stderr=True)
    for problem in reg.problems:
        err.print(f"[yellow]warning:[/] {problem}", highlight=False)
    if as_json:
        json.dump({"drafters": rows, "schedulers": schedulers, "problems": reg.problems}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    table = Table(title="dspec drafters")
    for col in ("name", "capabilities", "package", "version"):
        table.add_column(col)
    for row in rows:
        name = row["name"] + (f" ({', '.join(row['aliases'])})" if row["aliases"] else "")
        table.add_row(name, ", ".join(row["capabilities"]) or "-", row["package"], row["version"])
    Console().print(table)

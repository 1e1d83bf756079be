"""``dspec drafters``: list installed drafters (and schedulers) from every plugin."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from dspec_cli.cli import app
from dspec_cli.cli import options as opt
from dspec_cli.cli.progress import results_console
from dspec_cli.core import plugins
from dspec_cli.core.outputs import is_stdout, write_json
from dspec_cli.core.run_paths import RunPaths


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
    json_path: Optional[Path] = opt.json_path("the drafters and schedulers"),
) -> None:
    """List the drafters registered by installed plugins."""
    RunPaths().write("--json", json_path, stream=True).check()
    reg = plugins.registry()
    rows = drafter_rows(reg)
    schedulers = [
        {"name": n, "plugin": s.plugin, "package": s.package, "version": s.version}
        for n, s in sorted(reg.schedulers.items())
    ]
    for problem in reg.problems:
        warnings.warn(problem, stacklevel=1)
    if json_path is not None:
        opt.wrote(Console(stderr=True), write_json(json_path, {"drafters": rows, "schedulers": schedulers,
                                                               "problems": reg.problems}))
        if is_stdout(json_path):
            return
    table = Table(title="dspec drafters")
    for col in ("name", "capabilities", "package", "version"):
        table.add_column(col)
    for row in rows:
        name = row["name"] + (f" ({', '.join(row['aliases'])})" if row["aliases"] else "")
        table.add_row(name, ", ".join(row["capabilities"]) or "-", row["package"], row["version"])
    results_console().print(table)

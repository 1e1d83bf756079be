"""Training checkpoints: resumable state of a training run, written atomically.

Layout of a training output directory::

    OUT/config.json, model.safetensors, README.md   final drafter (``from_pretrained``-loadable)
    OUT/train_log.jsonl                              metrics, one row per logged step
    OUT/checkpoints/step_N/                          config.json + model.safetensors (loadable too),
                                                     optimizer.pt, scheduler.pt, rng_state.pt
                                                     (one entry per rank), recipe.json,
                                                     trainer_state.json (written last)
    OUT/checkpoints/latest                           text file: "step_N"

A checkpoint is written into a hidden temporary folder and renamed into place, then ``latest``
is replaced atomically, so an interrupted save never leaves a half-written ``step_N``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dspec_cli.core.errors import DspecError
from dspec_cli.core.jsonl import split_lines
from dspec_cli.core.outputs import atomic_write_text, is_special, is_stdout

CHECKPOINTS = "checkpoints"


LATEST = "latest"


STATE = "trainer_state.json"


_STEP = re.compile(r"^step_(\d+)$")


def capture_rng(device: torch.device) -> dict[str, Any]:
    """torch (CPU and this rank's CUDA device), numpy and python RNG states."""
    name, keys, pos, has_gauss, gauss = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_all(seed: int) -> None:
    """Seed torch, numpy and python ``random``."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def save_checkpoint(
    out: Path, step: int, drafter, optimizer, scheduler, state: dict, rng: list[dict], recipe: dict, keep: int = 0
) -> Path:
    """Write ``OUT/checkpoints/step_<step>`` atomically, point ``latest`` at it, prune old ones."""
    root = out / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    drafter.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng, tmp / "rng_state.pt")
    (tmp / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    (tmp / STATE).write_text(json.dumps({**state, "step": step}, indent=2) + "\n")
    old = None
    if final.exists():
        old = root / f".step_{step}.old-{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    if old is not None:
        shutil.rmtree(old)
    atomic_write_text(root / LATEST, final.name + "\n")
    if keep > 0:
        for path in _step_dirs(root)[:-keep]:
            if path != final:
                shutil.rmtree(path)
    return final


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint ``latest`` points at; else the newest complete ``step_N``; else None."""
    root = out / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if (path / STATE).is_file():
            return path
    complete = [p for p in _step_dirs(root) if (p / STATE).is_file()]
    return complete[-1] if complete else None


def _step_dirs(root: Path) -> list[Path]:
    """step_N folders sorted by N."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def read_state(path: Path) -> dict:
    try:
        return json.loads((path / STATE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DspecError(f"checkpoint {path}: {STATE} is unreadable ({exc})") from None


def load_checkpoint(path: Path, drafter, optimizer, scheduler, device: torch.device) -> list[dict]:
    """Restore weights, optimizer and scheduler from ``path``; return the per-rank RNG states."""

    try:
        weights = load_file(str(path / "model.safetensors"), device=str(device))
        drafter.net.load_state_dict(weights)
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        return torch.load(path / "rng_state.pt", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, ValueError, KeyError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DspecError(f"checkpoint {path}: cannot restore training state ({detail})") from None


def trim_log(path: Path, step: int) -> None:
    """Drop metrics-log rows past ``step`` (left by a run that went on after its last checkpoint)."""
    if is_stdout(path) or is_special(path) or not path.is_file():  # a stream is written, never read
        return
    keep = []
    for _, line in split_lines(path.read_text(encoding="utf-8")):
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except (json.JSONDecodeError, AttributeError):
            continue  # blank or partial line (interrupted write)
    atomic_write_text(path, "".join(f"{line}\n" for line in keep))

"""The drafter checkpoint format (docs/checkpoints.md) and training checkpoints.

A drafter checkpoint is a folder: ``config.json`` (:func:`checkpoint_config`), ``model.safetensors``
(trainable weights only), optional ``calibration.json``, ``cost_table.json`` and ``bench.json``,
and a ``README.md`` model card (:mod:`dspec_cli.model_card`). :func:`check_checkpoint_config`
validates a folder against a target; every field it reads is optional, so older checkpoints load.

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

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspec_cli.calibration import CALIBRATION_FILE, Calibration
from dspec_cli.errors import DspecError
from dspec_cli.hardware import CostTable
from dspec_cli.jsonl import split_lines
from dspec_cli.outputs import atomic_write_text

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
COST_TABLE_FILE = "cost_table.json"  # a dspec_cli.hardware.CostTable
BENCH_FILE = "bench.json"  # a `dspec bench --json` report
CARD_FILE = "README.md"
PUBLISHED_FILES = (CONFIG_FILE, WEIGHTS_FILE, CALIBRATION_FILE, COST_TABLE_FILE, BENCH_FILE, CARD_FILE)
CHECKPOINTS = "checkpoints"
LATEST = "latest"
STATE = "trainer_state.json"
_STEP = re.compile(r"^step_(\d+)$")


# -- RNG -----------------------------------------------------------------------------------------


def capture_rng(device: torch.device) -> dict[str, Any]:
    """torch (CPU and this rank's CUDA device), numpy and python RNG states."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
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


# -- save / find / load --------------------------------------------------------------------------


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
    from safetensors import SafetensorError
    from safetensors.torch import load_file

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
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        return
    keep = []
    for _, line in split_lines(path.read_text(encoding="utf-8")):
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except (json.JSONDecodeError, AttributeError):
            continue  # blank or partial line (interrupted write)
    atomic_write_text(path, "".join(f"{line}\n" for line in keep))


# -- the drafter checkpoint format ---------------------------------------------------------------


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the vocabulary (token -> id, sorted by token) and the sorted special tokens."""
    data = {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(map(str, tokenizer.all_special_tokens))}
    return hashlib.sha256(json.dumps(data, separators=(",", ":")).encode()).hexdigest()


def weights_fingerprint(model, sample: int = 65536) -> str:
    """sha256 over the shapes of all parameters and the first ``sample`` values of the input
    embedding, the output head and the last parameter: tells two checkpoints of one architecture
    apart (e.g. a retrained target under the same name) without reading every weight."""
    h = hashlib.sha256()
    params = list(model.named_parameters())
    for name, p in params:
        h.update(f"{name}:{tuple(p.shape)};".encode())
    picks = [model.get_input_embeddings().weight, model.get_output_embeddings().weight, params[-1][1]]
    for p in picks:
        h.update(p.detach().reshape(-1)[:sample].float().cpu().numpy().tobytes())
    return h.hexdigest()


def target_id(target) -> str:
    """How config.json names a target: "embedded", a Hub id (also for a Hub-cache snapshot), an
    absolute local path, or "" when unknown (a model built in memory)."""
    from dspec_cli.recipes import EMBEDDED
    from dspec_cli.target import DEFAULT_TARGET_PATH

    name = str(getattr(target.model.config, "_name_or_path", "") or "")
    if not name:
        return ""
    cached = re.search(r"models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$", name)
    if cached:
        return f"{cached.group(1)}/{cached.group(2)}"
    path = Path(name)
    if not path.exists():
        return name  # a Hub id that transformers resolved itself
    path = path.resolve()
    return EMBEDDED if path == DEFAULT_TARGET_PATH.resolve() else str(path)


def checkpoint_config(drafter) -> dict[str, Any]:
    """config.json of ``drafter``: name, dspec version, architectures, its target, its hyper-parameters."""
    from dspec_cli import __version__

    target = drafter.target
    info: dict[str, Any] = {"name_or_path": target_id(target), "vocab_size": target.vocab_size,
                            "hidden_size": target.hidden_size, "num_hidden_layers": target.num_layers}
    if target.tokenizer is not None:
        info["tokenizer_sha256"] = tokenizer_fingerprint(target.tokenizer)
    arch = "Dspec" + "".join(part.capitalize() for part in re.split(r"[^A-Za-z0-9]+", drafter.name)) + "Drafter"
    return {"drafter": drafter.name, "dspec_version": __version__, "architectures": [arch], "target": info,
            "drafter_config": drafter.config.to_dict()}


def read_config(path: Path) -> dict[str, Any]:
    """A checkpoint folder's config.json as a dict; one-line errors when missing or malformed."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise DspecError(f"checkpoint {path}: {CONFIG_FILE} is missing")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DspecError(f"checkpoint {path}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("drafter_config", {}), dict):
        raise DspecError(f"checkpoint {path}: {CONFIG_FILE} must be an object with a 'drafter_config' object")
    return raw


def config_target(raw: dict[str, Any]) -> dict[str, Any]:
    """The ``target`` section of a config.json ({} in checkpoints written before it existed)."""
    return raw["target"] if isinstance(raw.get("target"), dict) else {}


_SIZES = (("hidden_size", "hidden size", "hidden_size"), ("vocab_size", "vocabulary size", "vocab_size"),
          ("num_hidden_layers", "target layer count", "num_layers"))


def check_checkpoint_config(name: str, path: Path, target) -> None:
    """One-line errors for a checkpoint of another drafter, for another target (sizes, tokenizer),
    or with a malformed calibration.json / cost_table.json."""
    raw = read_config(path)
    saved = raw.get("drafter")
    if saved not in (None, name):
        raise DspecError(f"checkpoint {path} holds a {saved!r} drafter, not {name!r}")
    stored = {**{k: raw["drafter_config"].get(k) for k in ("hidden_size", "vocab_size")}, **config_target(raw)}
    for key, label, attr in _SIZES:
        got, want = stored.get(key), getattr(target, attr)
        if got and got != want:
            raise DspecError(f"checkpoint {path}: drafter {label} {got} does not match the target's {want}")
    fingerprint = stored.get("tokenizer_sha256")
    if fingerprint and target.tokenizer is not None:
        mine = tokenizer_fingerprint(target.tokenizer)
        if mine != fingerprint:
            raise DspecError(
                f"checkpoint {path}: the target's tokenizer differs from the drafter's "
                f"(fingerprint {mine[:12]} vs {fingerprint[:12]}): token ids would not match"
            )
    if (path / CALIBRATION_FILE).is_file():
        Calibration.load(path / CALIBRATION_FILE, drafter=name)
    if (path / COST_TABLE_FILE).is_file():
        CostTable.load(path / COST_TABLE_FILE)


def validate_checkpoint(path: Path, target: str | None = None, device: str = "cpu") -> dict[str, Any]:
    """Load the checkpoint in ``path`` against its target (``target``, else the one config.json
    names, else the embedded one) exactly as bench would; return its config."""
    from dspec_cli import plugins
    from dspec_cli.hardware import SlowHalfPrecision
    from dspec_cli.recipes import EMBEDDED
    from dspec_cli.target import Target

    path = Path(path)
    if not path.is_dir():
        raise DspecError(f"checkpoint {path}: no such folder")
    raw = read_config(path)
    if not isinstance(raw.get("drafter"), str):
        raise DspecError(f"checkpoint {path}: {CONFIG_FILE} names no drafter (not a dspec drafter checkpoint)")
    cls = plugins.get_drafter_class(raw["drafter"])
    name = target or config_target(raw).get("name_or_path")
    try:
        with warnings.catch_warnings():  # loaded to check shapes only: no matmul speed concern
            warnings.simplefilter("ignore", SlowHalfPrecision)
            tgt = Target.load(None if name in (None, "", EMBEDDED) else name, dtype="bfloat16", device=device)
    except DspecError as exc:
        raise DspecError(f"{exc} (pass --target to validate against another copy of the target)") from None
    cls.from_pretrained(path, tgt)
    return raw

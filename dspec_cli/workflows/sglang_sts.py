"""SGLang DSpark's STS side files: the temperatures file it reads and the collection shards it
writes (``SGLANG_DSPARK_STS_COLLECT_PATH=<stem>`` -> ``<stem>.N.pt``, a dict of ``logits``, the
confidence head's raw output, and ``prefix_mask``, 1 where the draft at that position and all
before it matched the target, both [n, γ] float32), as dspec calibration data. SGLang's DSpark
verifies token by token, so its shards are token-rule rounds and its STS file takes the token
rule's temperatures. Formats: SGLang ``python/sglang/srt/speculative/dspark_components/dspark_sts.py``
(docs/interop.md)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dspec_cli.core.calibration import CONFIDENCE_EPS, Calibration
from dspec_cli.core.errors import DspecError
from dspec_cli.workflows.calibrate import Rounds, load_traces

STS_FILE = "dspark_sts.json"
SGLANG_RULE = "token"  # the chain rule SGLang's DSpark verifies by


SHARD_KEYS = ("logits", "prefix_mask")


def sts_dict(cal: Calibration, *, dataset: str = "", num_samples: int = 0) -> dict:
    """SGLang's STS file from a calibration's token-rule fit (DspecError naming the command when
    it has none): its temperatures and, when every position has one, the per-position ECE of the
    survival product before and after them (dspec's 20-bin ECE)."""
    if SGLANG_RULE not in cal.fits:
        raise DspecError(f"{cal.source or 'the calibration'} has no fit for the {SGLANG_RULE} rule, which SGLang's "
                         f"DSpark verifies by (only {' and '.join(cal.rules)}): fit it with `dspec calibrate "
                         f"--drafter {cal.drafter or 'NAME'} --checkpoint DIR --verify {SGLANG_RULE} --in-place`")
    fit = cal.fits[SGLANG_RULE]
    metrics = fit.metrics
    before, after = (metrics.get(k, {}).get("ece") or [] for k in ("before", "sts" if "sts" in metrics else "after"))
    complete = all(isinstance(v, (int, float)) for v in (*before, *after)) and len(before) == len(after) == len(
        fit.temperatures)
    return {"temperatures": [float(t) for t in fit.temperatures], "dataset": dataset, "num_samples": int(num_samples),
            "ece_before": [float(v) for v in before] if complete else [],
            "ece_after": [float(v) for v in after] if complete else []}


def shard_files(path: str | Path) -> list[Path]:
    """One ``.pt`` shard, or every ``<stem>.N.pt`` of a collection stem, in N order."""
    path = Path(path)
    if path.suffix == ".pt" and path.is_file():
        return [path]
    pattern = re.compile(re.escape(path.name) + r"\.(\d+)\.pt")
    found = [(int(m.group(1)), p) for p in path.parent.glob(f"{path.name}.*.pt") if (m := pattern.fullmatch(p.name))]
    if not found:
        raise DspecError(f"traces {path}: file not found, nor STS shards {path.name}.N.pt (SGLANG_DSPARK_STS_COLLECT_PATH's stem)")
    return [p for _, p in sorted(found)]


def read_shard(path: Path, block_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [n, γ], prefix_mask [n, γ] bool) of one shard, loaded without unpickling code."""
    try:
        shard = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one line
        raise DspecError(f"STS shard {path}: unreadable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") from None
    if not isinstance(shard, dict) or any(not isinstance(shard.get(k), torch.Tensor) for k in SHARD_KEYS):
        raise DspecError(f"STS shard {path}: expected a dict of tensors 'logits' and 'prefix_mask'")
    logits, mask = shard["logits"], shard["prefix_mask"]
    if logits.dim() != 2 or logits.shape != mask.shape:
        raise DspecError(f"STS shard {path}: logits {list(logits.shape)} and prefix_mask {list(mask.shape)} "
                         "must both be [n, γ]")
    if block_size is not None and logits.shape[1] != block_size:
        raise DspecError(f"STS shard {path}: γ = {logits.shape[1]}, expected {block_size}")
    if not bool(torch.isfinite(logits).all()):
        raise DspecError(f"STS shard {path}: logits hold non-finite values")
    flags = mask.bool()
    if not bool(((mask == 0) | (mask == 1)).all()) or bool((flags[:, 1:] & ~flags[:, :-1]).any()):
        raise DspecError(f"STS shard {path}: prefix_mask rows must be 1s followed by 0s")
    return logits.double(), flags


def load_sts_shards(path: str | Path, block_size: int | None = None) -> Rounds:
    """Rounds from SGLang's STS collection: confidences σ(logits), every position verified
    (SGLang scores the whole block), accepted = the length of the prefix mask."""
    logits, masks = [], []
    for file in shard_files(path):
        lg, mk = read_shard(file, block_size)
        block_size = lg.shape[1]
        logits.append(lg)
        masks.append(mk)
    logit, mask = torch.cat(logits), torch.cat(masks)
    confidence = torch.sigmoid(logit).clamp(CONFIDENCE_EPS, 1 - CONFIDENCE_EPS)
    verified = torch.full((logit.shape[0],), logit.shape[1], dtype=torch.long)
    return Rounds(confidence, verified, mask.long().sum(1))


def load_rounds(path: str | Path, block_size: int | None = None) -> tuple[Rounds, dict]:
    """Recorded rounds and their {"drafter", "block_size", "verify"} (the rule; None when a trace
    file does not record it): a dspec trace file (jsonl) or SGLang STS shards (a ``.pt`` file or
    a collection stem: the token rule)."""
    path = Path(path)
    if path.is_file() and path.suffix != ".pt":
        rounds, meta = load_traces(path)
        if block_size is not None and meta["block_size"] != block_size:
            raise DspecError(f"traces {path}: block size {meta['block_size']}, expected {block_size}")
        return rounds, meta
    rounds = load_sts_shards(path, block_size)
    return rounds, {"drafter": "", "block_size": rounds.block_size, "verify": SGLANG_RULE}

"""``dspec train --report-to tensorboard``: the metrics log rows, also written as TensorBoard scalars."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dspec_cli.core.errors import DspecError

KNOWN = ("tensorboard",)


def check(names: Sequence[str]) -> None:
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise DspecError(f"--report-to {unknown[0]!r}: expected one of {', '.join(KNOWN)}")


class Reporters:
    """Writes each logged row to the requested trackers (rank 0 only; none = no-op)."""

    def __init__(self, names: Sequence[str], out: Path):
        check(names)
        self.writer = None
        if "tensorboard" in names:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise DspecError("--report-to tensorboard needs the tensorboard package: pip install 'dspec[tensorboard]'") from None
            self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))

    def log(self, row: dict) -> None:
        if self.writer is None:
            return
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float):
                self.writer.add_scalar(f"train/{key}", value, row["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

"""A dspec checkpoint's ``config.json`` as typed records (docs/checkpoints.md), validated by pydantic.

:class:`CheckpointConfig` is the file: the drafter's name, the dspec version and architecture it
was written by, the target it was trained for (:class:`TargetRecord`), the chat-template kwargs
of its training data and ``drafter_config``, the drafter's hyper-parameters, which each drafter
types with its own :class:`DrafterConfig` subclass. The file is read as strict JSON and the
records are :class:`~dspec_cli.core.records.Record` s (strict types: no ``"7"`` for 7; finite
numbers); a file that does not fit is a one-line error naming the file and the field.
Fields other than ``drafter`` and ``drafter_config`` are optional, so older checkpoints load.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import ConfigDict, Field, PositiveInt, TypeAdapter, ValidationError

from dspec_cli.core.chat_template import default_kwargs
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import CONFIG_FILE, read_config
from dspec_cli.core.records import Record, describe_error, validate
from dspec_cli.core.specs import check_block_size

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

    from dspec_cli.core.calibration import Calibration


@dataclass
class DrafterConfig:
    """Hyper-parameters serialised into a checkpoint's config.json. Subclass to add fields."""

    __pydantic_config__ = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")  # how from_dict types the fields

    block_size: int = 7  # γ: draft tokens proposed per round
    target_layer_ids: tuple[int, ...] = ()  # target decoder layers the drafter reads (-1 = embeddings)

    def __post_init__(self) -> None:
        check_block_size(self.block_size, "block_size")
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, where: str = "config") -> Self:
        """Build from a dict of JSON values, each checked against its field's type; unknown keys
        are an error that lists the valid ones."""
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise DspecError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(valid)}")
        try:
            return _adapter(cls).validate_json(json.dumps(values))
        except ValidationError as exc:
            raise DspecError(f"{where}: {describe_error(exc)}") from None
        except DspecError as exc:  # a rule of the drafter's own (__post_init__)
            raise DspecError(f"{where}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


class TargetRecord(Record):
    """config.json ``target``: the target a checkpoint was trained for ("embedded", a Hub id or an
    absolute local path; "" when unknown) and its sizes and tokenizer, checked when it loads."""

    model_config = ConfigDict(extra="allow")  # Record's rules otherwise

    name_or_path: str = ""
    vocab_size: PositiveInt | None = None
    hidden_size: PositiveInt | None = None
    num_hidden_layers: PositiveInt | None = None
    tokenizer_sha256: str | None = None


class BlockSizeError(DspecError):
    """A block size beyond the one a checkpoint was trained with (the message says what to use)."""


class CheckpointConfig(Record):
    """config.json of a dspec drafter checkpoint (see the module docstring)."""

    model_config = ConfigDict(extra="allow")  # Record's rules otherwise

    drafter: str
    dspec_version: str = ""
    architectures: list[str] = []
    target: TargetRecord = TargetRecord()
    # the kwargs its training data was rendered with; null: not known. Checkpoints written before
    # dspec recorded them were trained with the default, which was then the only setting
    chat_template_kwargs: dict[str, Any] | None = Field(default_factory=default_kwargs)
    drafter_config: dict[str, Any]  # typed by the drafter's DrafterConfig; block_size checked here

    @classmethod
    def parse(cls, raw: dict[str, Any], folder: str | Path) -> CheckpointConfig:
        """The record of config.json ``raw`` (read from ``folder`` as strict JSON by
        :func:`~dspec_cli.core.files.read_config`); DspecError naming the file and the field when
        it does not fit."""
        where = f"checkpoint {Path(folder) / CONFIG_FILE}"
        config = validate(cls, raw, where)
        if "block_size" not in config.drafter_config:
            raise DspecError(f"{where}: drafter_config.block_size: missing")
        try:
            check_block_size(config.drafter_config["block_size"], "drafter_config.block_size")
        except DspecError as exc:
            raise DspecError(f"{where}: {exc}") from None
        return config

    def check_trained_block_size(self, wanted: int | None, folder: str | Path) -> None:
        """A block size to load with (None: the trained one) is at most the trained one."""
        trained = self.drafter_config["block_size"]
        if wanted is not None and wanted > trained:
            raise BlockSizeError(f"--block-size {wanted} exceeds the {trained} positions drafter {self.drafter!r} was "
                                 f"trained for ({folder}); use --block-size {trained} or less")

    @classmethod
    def read(cls, folder: str | Path) -> CheckpointConfig:
        """The record of ``folder``'s config.json (:meth:`parse`)."""
        return cls.parse(read_config(Path(folder)), folder)


class Checkpointed(Protocol):
    """A drafter class as checkpoints/ sees it (``runtime.drafter.Drafter``, which it never
    imports): its registry name, config type, constructors, and what a checkpoint records of it."""

    name: ClassVar[str]
    config_class: ClassVar[type[DrafterConfig]]
    calibration: Calibration | None
    chat_template_kwargs: dict[str, Any] | None

    @classmethod
    def build(cls, config: Any, target: Any) -> Self: ...

    @classmethod
    def from_pretrained(cls, path: str | Path, target: Any, **overrides: Any) -> Self: ...


class Trained(Checkpointed, Protocol):
    """A drafter class with trainable weights ``net`` (``runtime.drafter.TrainableDrafter``)."""

    net: torch.nn.Module

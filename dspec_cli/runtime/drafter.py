"""The drafter interface every plugin implements (docs/plugins.md).

A drafter proposes up to γ tokens per request per round. The engine owns the loop:

    state = drafter.init_state()
    drafter.add_requests(state, prompts, hidden)          # new rows join (continuous batching)
    loop:
        proposal = drafter.propose(state, anchors, max_len, sampler)
        ... scheduler picks ℓ_r, target verifies, verifier accepts ...
        drafter.advance(state, committed, counts, hidden)  # only committed tokens enter caches
    drafter.remove_requests(state, keep)                  # finished rows leave

Rows of every per-request tensor follow the engine's batch order.

Capture (CUDA graphs, docs/architecture.md): a drafter whose :meth:`Drafter.capture_key` is not
None has its ``propose`` and :meth:`Drafter.advance_grid` run as captured graphs. Both must then
read no host values (no ``.item()``, ``.tolist()``, ``bool(t)``, boolean indexing; see
:mod:`dspec_cli.core.host`), take rows padded past R (padding rows have length 0 and count 0),
and keep their state's storage in place (room made by :meth:`Drafter.reserve`, host bounds
tightened in :meth:`Drafter.settle`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dspec_cli.checkpoints.layouts import load_foreign
from dspec_cli.checkpoints.native import (
    check_checkpoint_config,
    checkpoint_config,
    recorded_chat_template_kwargs,
)
from dspec_cli.core.calibration import Calibration
from dspec_cli.core.chat_template import warn_if_other
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import (
    CALIBRATION_FILE,
    CONFIG_FILE,
    WEIGHTS_FILE,
    embedded_path,
    read_config,
)
from dspec_cli.core.ragged import prefix_mask, ragged
from dspec_cli.core.types import Capability, Proposal, Sampler

if TYPE_CHECKING:
    from typing_extensions import Self

    from dspec_cli.runtime.target import Target
    from dspec_cli.training.data import TrainData

CAPABILITIES = tuple(Capability)


@dataclass
class DrafterConfig:
    """Hyper-parameters serialised into a checkpoint's config.json. Subclass to add fields."""

    block_size: int = 7  # γ: draft tokens proposed per round
    target_layer_ids: tuple[int, ...] = ()  # target decoder layers the drafter reads (-1 = embeddings)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise DspecError(f"block_size must be >= 1, got {self.block_size}")
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, where: str = "config") -> Self:
        """Build from a dict; unknown keys are an error that lists the valid ones."""
        valid = cls.field_names()
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise DspecError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(valid)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


@dataclass
class DraftState:
    """Per-batch drafter state. Subclasses add caches; rows follow the engine's batch order."""

    context: list[torch.Tensor] = field(default_factory=list)  # committed token ids per request [L_r]

    @property
    def num_requests(self) -> int:
        return len(self.context)


def heuristic_confidence(draft_probs: torch.Tensor | None, lengths: torch.Tensor, gamma: int) -> torch.Tensor:
    """Non-anticipating confidence from the shape of q_k: Σ_v q_k(v)², never q_k(x_k).

    Σq² is the chance that the target (if it matched q) would draw the token the draft drew,
    so it only uses the distribution the draft token is sampled from. draft_probs [R, γ, V]
    (None: one-hot drafts, which get 0.5: no information), lengths [R]. Returns [R, γ] in (0, 1).
    """
    R = lengths.shape[0]
    if draft_probs is None:
        conf = torch.full((R, gamma), 0.5, device=lengths.device)
    else:
        conf = draft_probs.float().pow(2).sum(-1)  # [R, γ]
    return conf.clamp(1e-4, 1 - 1e-4)


class Drafter:
    """Base class of every drafter. Class attributes describe it to the plugin registry."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type[DrafterConfig]] = DrafterConfig
    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    description: ClassVar[str] = ""
    # STS temperatures from the checkpoint's calibration.json; the engine applies them to every
    # proposal's confidences (the one place calibration is applied). None: confidences as drafted.
    calibration: Calibration | None = None
    # the chat-template kwargs its training data was rendered with (checkpoint config.json; set by
    # `dspec train`); None: not known (untrained drafters, foreign layouts)
    chat_template_kwargs: dict[str, Any] | None = None

    def __init__(self, config: DrafterConfig, target: Target):
        self.config = config
        self.target = target

    # -- construction and persistence ------------------------------------------------
    @classmethod
    def build(cls, config: DrafterConfig, target: Target) -> Self:
        """A fresh (untrained) drafter for ``target``."""
        return cls(config, target)

    @classmethod
    def load_default(cls, target: Target, **overrides: Any) -> Self:
        """The drafter used when no checkpoint is given (trained drafters: the embedded one)."""
        return cls.build(cls.config_class(**overrides), target)

    @classmethod
    def from_pretrained(cls, path: str | Path, target: Target, **overrides: Any) -> Self:
        """Load a checkpoint folder written by :meth:`save_pretrained`."""
        path = Path(path)
        values = {**read_config(path).get("drafter_config", {}), **overrides}
        return cls.build(cls.config_class.from_dict(values, where=str(path / CONFIG_FILE)), target)

    def save_pretrained(self, path: str | Path) -> None:
        """Write config.json (:func:`~dspec_cli.checkpoints.native.checkpoint_config`)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(json.dumps(checkpoint_config(self), indent=2) + "\n")
        if self.calibration is not None:
            self.calibration.save(path / CALIBRATION_FILE)

    # -- the decoding cycle ----------------------------------------------------------
    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.config.target_layer_ids)

    def init_state(self) -> DraftState:
        return DraftState()

    def add_requests(self, state: DraftState, prompts: list[torch.Tensor], hidden: list[torch.Tensor] | None) -> None:
        """New requests join: prompts, ids [L_r] per request; hidden [L_r, n·d] per request, the
        target's taps (None if no taps)."""
        state.context.extend(p.clone() for p in prompts)

    def remove_requests(self, state: DraftState, keep: list[int]) -> None:
        """Keep only rows ``keep`` (in that order)."""
        state.context = [state.context[i] for i in keep]

    def propose(self, state: DraftState, anchors: torch.Tensor, max_len: int, sampler: Sampler) -> Proposal:
        """Draft up to ``max_len`` tokens after each anchor. anchors [R] long."""
        raise NotImplementedError

    def confidence(self, state: DraftState, proposal: Proposal) -> torch.Tensor:
        """[R, γ] per-position confidence; default: :func:`heuristic_confidence`."""
        return heuristic_confidence(proposal.draft_probs, proposal.lengths, proposal.tokens.shape[1])

    def advance(
        self, state: DraftState, committed: torch.Tensor, counts: torch.Tensor, hidden: torch.Tensor | None
    ) -> None:
        """Tokens that entered each request's context since the last call, row by row in order:
        the anchor + accepted drafts of the round just verified, or, after rounds the engine ran
        without drafting (draft gate), the tokens of all those rounds (counts may exceed γ + 1).

        committed [Σc_r] long, counts [R] long, hidden [Σc_r, n·d] target taps or None.
        """
        for r, chunk in enumerate(torch.split(committed, counts.tolist())):
            state.context[r] = torch.cat([state.context[r], chunk])

    def advance_grid(
        self, state: DraftState, committed: torch.Tensor, counts: torch.Tensor, hidden: torch.Tensor | None
    ) -> None:
        """:meth:`advance` from padded rows: committed [R, W] of which the first counts [R] per row
        entered the context, hidden [R, W, n·d] their taps or None. Default: the ragged
        :meth:`advance` (one host read of ``counts``); capturable drafters override it (rows past
        R are then padding, with count 0)."""
        counts = counts[: self.num_rows(state)]
        counts_list = counts.tolist()
        keep = prefix_mask(counts, committed.shape[1])
        flat = ragged(committed[: len(counts_list)], counts, counts_list)
        taps = None if hidden is None else hidden[: len(counts_list)][keep]
        self.advance(state, flat, counts, taps)

    def num_rows(self, state: DraftState) -> int:
        """Requests (rows) the state holds."""
        return state.num_requests

    # -- capture (CUDA graphs) --------------------------------------------------------------
    def reserve(self, state: DraftState, rows: int, slots: int) -> bool:
        """Room for ``rows`` rows (padding rows of a captured graph included) of up to ``slots``
        committed tokens each, made before the rounds so that they never reallocate the state;
        True when state storage was reallocated (graphs captured over it are then stale).
        Default: nothing."""
        return False

    def verify_tokens(self, max_len: int) -> int:
        """Most tokens per row a round with proposals of up to ``max_len`` drafts sends to the
        target, the anchor included (the engine reserves cache room for them): ``max_len + 1``
        for chains; tree drafters return their node budget + 1."""
        return max_len + 1

    def capture_key(self, state: DraftState, bucket: int) -> Hashable | None:
        """What this round's :meth:`propose` and :meth:`advance_grid` shapes and state storage
        depend on besides the rows, with attention windows rounded up to ``bucket`` slots; None
        (the default): not capturable, both run eagerly. See the module docstring."""
        return None

    def settle(self, state: DraftState, lengths: list[int]) -> None:
        """After each engine round: the target's committed tokens per row, an upper bound of each
        row's context, for drafters that keep host-side bounds. Default: nothing."""

    def training_loss(self, batch: dict[str, torch.Tensor], target_features: dict[str, torch.Tensor]) -> dict:
        """See :class:`TrainableDrafter`: batch tensors [B, L], target_features [B, L, ·]."""
        raise DspecError(f"drafter {self.name!r} is not trainable")


class WrappedDrafter(Drafter):
    """A drafter over another one, ``self.base``, whose state it keeps: the decoding cycle's state
    methods pass through; subclasses change :meth:`propose` (e.g. ddtree's trees)."""

    base: Drafter

    @property
    def calibration(self) -> Calibration | None:  # the base drafter's confidences, so its STS
        return self.base.calibration

    @calibration.setter
    def calibration(self, value: Calibration | None) -> None:
        self.base.calibration = value

    @property
    def chat_template_kwargs(self) -> dict[str, Any] | None:  # the base drafter's training
        return self.base.chat_template_kwargs

    @chat_template_kwargs.setter
    def chat_template_kwargs(self, value: dict[str, Any] | None) -> None:
        self.base.chat_template_kwargs = value

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.base.target_layer_ids

    def init_state(self) -> DraftState:
        return self.base.init_state()

    def add_requests(self, state: DraftState, prompts: list[torch.Tensor], hidden: list[torch.Tensor] | None) -> None:
        """The base's: prompts [L_r] and hidden [L_r, n·d] (or None) per request."""
        self.base.add_requests(state, prompts, hidden)

    def remove_requests(self, state: DraftState, keep: list[int]) -> None:
        self.base.remove_requests(state, keep)

    def advance(
        self, state: DraftState, committed: torch.Tensor, counts: torch.Tensor, hidden: torch.Tensor | None
    ) -> None:
        """The committed tokens (for a tree: the accepted path) enter the base's caches:
        committed [Σc_r], counts [R], hidden [Σc_r, n·d] or None (:meth:`Drafter.advance`)."""
        self.base.advance(state, committed, counts, hidden)

    def advance_grid(self, state: DraftState, committed, counts, hidden) -> None:
        self.base.advance_grid(state, committed, counts, hidden)

    def num_rows(self, state: DraftState) -> int:
        return self.base.num_rows(state)

    def reserve(self, state: DraftState, rows: int, slots: int) -> bool:
        return self.base.reserve(state, rows, slots)

    def verify_tokens(self, max_len: int) -> int:
        return self.base.verify_tokens(max_len)

    def capture_key(self, state: DraftState, bucket: int) -> Hashable | None:
        key = self.base.capture_key(state, bucket)
        return None if key is None else (self.name, key)

    def settle(self, state: DraftState, lengths: list[int]) -> None:
        self.base.settle(state, lengths)


class TrainableDrafter(Drafter):
    """A drafter with trainable weights in ``self.net`` (an ``nn.Module``).

    Checkpoints hold only these weights (``model.safetensors``); frozen parts shared with the
    target (embedding, LM head) are taken from the target at load time. ``training_loss``
    receives a batch ``{"input_ids" [B, L], "loss_mask" [B, L], "attention_mask" [B, L]}`` and
    target features ``{"taps" [B, L, n·d] (raw outputs of target_layer_ids), "last_hidden"
    [B, L, d] (final-norm output; logits = target.lm_head(last_hidden))}`` and returns
    ``{"loss": scalar tensor, ...float metrics}``.
    """

    net: torch.nn.Module

    def prepare_training(self, data: TrainData) -> None:
        """Called once before training with the training data; default: nothing."""

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.net.parameters() if p.requires_grad]

    def save_pretrained(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        super().save_pretrained(path)
        state = {k: v.detach().contiguous().cpu() for k, v in self.net.state_dict().items()}
        save_file(state, str(Path(path) / WEIGHTS_FILE))

    @classmethod
    def load_default(cls, target: Target, **overrides: Any) -> Self:
        """The embedded drafter ``assets/drafters/<name>/`` if it fits ``target``."""

        path = embedded_path("drafters") / cls.name
        hint = f"train one with `dspec train --drafter {cls.name} --recipe RECIPE` or pass --checkpoint PATH"
        if not (path / "config.json").is_file():
            raise DspecError(f"no trained {cls.name} drafter is embedded; {hint}")
        _check_block_size(cls.name, path, overrides.get("block_size"))
        try:
            return cls.from_pretrained(path, target, **overrides)
        except DspecError as exc:
            raise DspecError(f"the embedded {cls.name} drafter does not fit this target ({exc}); {hint}") from None

    @classmethod
    def from_pretrained(cls, path: str | Path, target: Target, **overrides: Any) -> Self:
        from safetensors import SafetensorError
        from safetensors.torch import load_file


        path = Path(path)
        if (foreign := load_foreign(cls, path, target, overrides)) is not None:
            return foreign  # another project's layout (DeepSpec, z-lab DFlash, EAGLE-3), converted in memory
        check_checkpoint_config(cls.name, path, target)
        _check_block_size(cls.name, path, overrides.get("block_size"))
        drafter = super().from_pretrained(path, target, **overrides)
        weights = path / WEIGHTS_FILE
        if not weights.is_file():
            raise DspecError(f"checkpoint {path}: {WEIGHTS_FILE} is missing")
        try:
            state = load_file(str(weights), device=str(target.device))
        except (SafetensorError, OSError) as exc:
            raise DspecError(f"checkpoint {path}: {WEIGHTS_FILE} is corrupt ({exc})") from None
        try:
            missing, unexpected = drafter.net.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # size mismatch
            detail = str(exc).strip().splitlines()[-1].strip()
            raise DspecError(f"checkpoint {path}: weights do not fit drafter {cls.name!r} ({detail})") from None
        if missing or unexpected:
            raise DspecError(
                f"checkpoint {path}: weights do not match drafter {cls.name!r} "
                f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
            )
        if (path / CALIBRATION_FILE).is_file():  # validated by check_checkpoint_config
            drafter.calibration = Calibration.load(path / CALIBRATION_FILE, drafter=cls.name)
        drafter.chat_template_kwargs = recorded_chat_template_kwargs(path)
        return drafter


def warn_if_other_kwargs(drafter: Drafter, used: Mapping[str, Any], tokenizer=None, name: str | None = None,
                          calibration: bool = True) -> None:
    """A one-line warning when ``drafter`` (``name``: as the command names it) runs under chat-template
    kwargs ``used`` that the target's template (``tokenizer``'s) renders differently from those its
    training data was rendered with, and (``calibration``) another when its calibration was fitted
    under yet other ones (:func:`~dspec_cli.core.chat_template.warn_if_other`)."""
    name = name or drafter.name
    trained, cal = drafter.chat_template_kwargs, drafter.calibration if calibration else None
    warn_if_other(f"drafter {name} was trained", trained, used, tokenizer, stacklevel=3)  # as the caller's
    if cal is not None and cal.chat_template_kwargs != trained:
        warn_if_other(f"the calibration of drafter {name} ({cal.source or 'calibration.json'}) was fitted",
                      cal.chat_template_kwargs, used, tokenizer,
                      effect="its temperatures fit the confidences of other prompts", stacklevel=3)


def _check_block_size(name: str, path: Path, wanted: int | None) -> None:
    """A block larger than the one a checkpoint was trained with is an error naming both."""
    trained = read_config(path).get("drafter_config", {}).get("block_size")
    if isinstance(trained, int) and wanted is not None and wanted > trained:
        raise DspecError(f"--block-size {wanted} exceeds the {trained} positions drafter {name!r} was trained for "
                         f"({path}); use --block-size {trained} or less")

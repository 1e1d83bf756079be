"""Training data: chat-template tokenisation with assistant loss masks, the deterministic
sample order shared by all ranks, batching, and the target features of a batch (computed
online by the frozen target, optionally cached on disk).

Conversations are rendered with the recipe's chat-template kwargs (``[chat_template]``, default
:data:`~dspec_cli.core.chat_template.DEFAULT_KWARGS`), the same ones regeneration used (its lines
record them: :attr:`TrainData.recorded_kwargs` counts them, and training warns on others). Loss
mask: 1 on every token of an assistant message's content through its end-of-turn marker
(``<|im_end|>\\n`` for ChatML; found by rendering a probe conversation), 0 elsewhere
(system/user turns, role headers, template-inserted thinking stubs).

Templates that rewrite earlier assistant turns (Qwen3's drops the thinking of every turn before
the last user message, as servers do when the conversation continues) do not render a
multi-turn conversation with every answer as generated. Such a conversation becomes one sample
per assistant turn: the conversation up to that turn, rendered as the target saw it when it
answered, with the loss on that turn only. Samples longer than ``max_length`` tokens keep their
first ``max_length`` (counted as truncated).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspec_cli.core.chat_template import DEFAULT_KWARGS, describe
from dspec_cli.core.data import Conversation, load_conversations
from dspec_cli.core.errors import DspecError
from dspec_cli.core.outputs import atomic_write_text, ensure_folder, write_atomic

_PROBE = "\u2063dspec-probe\u2063"
_TOKENIZE_CHUNK = 512  # conversations per batched tokenizer call


# -- tokenisation --------------------------------------------------------------------------------


def end_of_turn(tokenizer, chat_template_kwargs: Mapping[str, Any] = DEFAULT_KWARGS) -> str:
    """Text the chat template puts after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    text = _render(tokenizer, msgs, chat_template_kwargs)
    return text[text.rindex(_PROBE) + len(_PROBE) :]


def _render(tokenizer, messages: Sequence[dict], chat_template_kwargs: Mapping[str, Any]) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise DspecError("the target's tokenizer has no chat template; training data needs one")
    return tokenizer.apply_chat_template(list(messages), tokenize=False, **chat_template_kwargs)


def assistant_spans(text: str, messages: Sequence[dict], eot: str, where: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of assistant contents (+ end-of-turn marker) in ``text``."""
    spans, cursor = [], 0
    for i, msg in enumerate(messages):
        core = msg["content"].strip()
        if not core:
            continue  # an empty turn carries no loss tokens
        pos = text.find(core, cursor)
        if pos < 0:
            raise DspecError(f"{where}: message {i} is not found in the chat-template rendering")
        cursor = pos + len(core)
        if msg["role"] == "assistant":
            spans.append((pos, _turn_end(text, cursor, eot)))
            cursor = spans[-1][1]
    return spans


def _turn_end(text: str, cursor: int, eot: str) -> int:
    """End of the assistant turn whose content ends at ``cursor``: after its end-of-turn marker."""
    end = text.find(eot, cursor) if eot else -1
    return end + len(eot) if end >= 0 else cursor


def render_samples(conv: Conversation, tokenizer, eot: str,
                   chat_template_kwargs: Mapping[str, Any] = DEFAULT_KWARGS) -> list[tuple[str, str, list[tuple[int, int]]]]:
    """(sample id, text, assistant spans) of one conversation: one sample, or one per assistant
    turn (ids ``<id>/<turn>``, the loss on that turn only) when the template rewrites earlier
    assistant turns (see the module docstring)."""
    text = _render(tokenizer, conv.messages, chat_template_kwargs)
    try:
        return [(conv.id, text, assistant_spans(text, conv.messages, eot, conv.where))]
    except DspecError:
        answers = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant" and m["content"].strip()]
        if len(answers) < 2:
            raise
    samples = []
    for turn, i in enumerate(answers, start=1):
        text = _render(tokenizer, conv.messages[: i + 1], chat_template_kwargs)
        core = conv.messages[i]["content"].strip()
        pos = text.rfind(core)
        if pos < 0:
            raise DspecError(f"{conv.where}: message {i} is not found in the chat-template rendering")
        samples.append((f"{conv.id}/{turn}", text, [(pos, _turn_end(text, pos + len(core), eot))]))
    return samples


def _token_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """[L] uint8: tokens whose character range [s, e) overlaps a span."""
    s, e = offsets[:, 0], offsets[:, 1]
    e = np.maximum(e, s + 1)  # zero-width tokens count at their position
    mask = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        mask |= (s < b) & (e > a)
    return mask.astype(np.uint8)


@dataclass
class TrainData:
    """Tokenised samples stored flat: sample i is ``ids[offsets[i]:offsets[i+1]]``."""

    ids: np.ndarray  # [T] int32
    mask: np.ndarray  # [T] uint8 loss mask
    offsets: np.ndarray  # [N+1] int64
    sample_ids: list[str]  # conversation id per sample (``<id>/<turn>`` for per-turn samples)
    skipped: int  # samples dropped for having < min_loss_tokens assistant tokens
    source: str
    truncated: int = 0  # samples cut to max_length tokens
    split: int = 0  # conversations rendered as one sample per assistant turn
    conversations: int = 0  # conversations read
    # chat-template kwargs the conversations' lines record (compact JSON, :func:`describe`) -> how many
    recorded_kwargs: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.mask.sum())

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.mask[a:b]

    def collate(self, indices: Sequence[int], pad_id: int, device) -> dict[str, torch.Tensor]:
        """Right-padded batch: input_ids / loss_mask / attention_mask [B, L]."""
        parts = [self.sample(i) for i in indices]
        width = max(len(ids) for ids, _ in parts)
        ids = np.full((len(parts), width), pad_id, dtype=np.int64)
        loss = np.zeros((len(parts), width), dtype=np.int64)
        att = np.zeros((len(parts), width), dtype=np.int64)
        for r, (x, m) in enumerate(parts):
            ids[r, : len(x)], loss[r, : len(x)], att[r, : len(x)] = x, m, 1
        arrays = {"input_ids": ids, "loss_mask": loss, "attention_mask": att}
        return {k: torch.from_numpy(v).to(device) for k, v in arrays.items()}


def tokenize_conversations(
    convs: Sequence[Conversation], tokenizer, max_length: int, min_loss_tokens: int, source: str,
    chat_template_kwargs: Mapping[str, Any] = DEFAULT_KWARGS,
) -> TrainData:
    """Render (:func:`render_samples`), tokenise, mask and truncate; samples with too few loss
    tokens are skipped."""
    eot = end_of_turn(tokenizer, chat_template_kwargs)
    ids_parts, mask_parts, lengths, names = [], [], [], []
    skipped = truncated = split = total_loss = 0
    for start in range(0, len(convs), _TOKENIZE_CHUNK):
        samples = []
        for conv in convs[start : start + _TOKENIZE_CHUNK]:
            rendered = render_samples(conv, tokenizer, eot, chat_template_kwargs)
            split += rendered[0][0] != conv.id
            samples += rendered
        enc = tokenizer([text for _, text, _ in samples], add_special_tokens=False, return_offsets_mapping=True)
        for (name, _, spans), ids, offs in zip(samples, enc["input_ids"], enc["offset_mapping"], strict=True):
            mask = _token_mask(np.asarray(offs, dtype=np.int64).reshape(-1, 2), spans)[:max_length]
            n_loss = int(mask.sum())
            total_loss += n_loss
            if n_loss < max(min_loss_tokens, 1):
                skipped += 1
                continue
            truncated += len(ids) > max_length
            ids_parts.append(np.asarray(ids[:max_length], dtype=np.int32))
            mask_parts.append(mask)
            lengths.append(len(mask))
            names.append(name)
    if total_loss == 0:
        raise DspecError(f"{source}: data has no assistant tokens (regenerate it with `dspec data regenerate`)")
    if not names:
        raise DspecError(
            f"{source}: every sample has fewer than {min_loss_tokens} assistant tokens (data.min_loss_tokens)"
        )
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    recorded = Counter(describe(c.chat_template_kwargs) for c in convs if c.chat_template_kwargs is not None)
    return TrainData(np.concatenate(ids_parts), np.concatenate(mask_parts), offsets, names, skipped, source,
                     truncated, split, len(convs), dict(recorded))


def load_train_data(paths: Sequence[str], tokenizer, max_length: int, min_loss_tokens: int,
                    limit: int = 0, chat_template_kwargs: Mapping[str, Any] = DEFAULT_KWARGS) -> TrainData:
    """Conversations from jsonl files, concatenated in order (see
    :func:`dspec_cli.core.data.load_conversations`), tokenised; ``limit`` caps the total."""
    if not paths:
        raise DspecError("recipe: data.path is empty (point it at `dspec data regenerate` output)")
    if max_length < 2:
        raise DspecError(f"recipe: data.max_length must be >= 2, got {max_length}")
    convs = []
    for path in paths:
        convs += load_conversations(path, (limit - len(convs)) if limit else None)
        if limit and len(convs) >= limit:
            break
    return tokenize_conversations(convs, tokenizer, max_length, min_loss_tokens, ", ".join(paths),
                                  chat_template_kwargs)


# -- sample order --------------------------------------------------------------------------------


class DataOrder:
    """Samples as one stream of per-epoch permutations (seeded); step s consumes stream items
    [s·G, (s+1)·G). Rank r takes every world-th item of the step (DistributedSampler style)."""

    def __init__(self, num_samples: int, global_batch: int, seed: int):
        self.n, self.g, self.seed = num_samples, global_batch, seed
        self._perms: dict[int, list[int]] = {}

    def steps_for(self, epochs: float) -> int:
        return max(1, math.ceil(epochs * self.n / self.g))

    def epoch_at(self, step: int) -> float:
        return step * self.g / self.n

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:  # keep one epoch: steps walk the stream forward
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=gen).tolist()}
        return self._perms[epoch]

    def step_indices(self, step: int) -> list[int]:
        return [self._perm(j // self.n)[j % self.n] for j in range(step * self.g, (step + 1) * self.g)]

    def micro_batches(self, step: int, rank: int, world: int, micro_batch: int) -> list[list[int]]:
        mine = self.step_indices(step)[rank::world]
        return [mine[i : i + micro_batch] for i in range(0, len(mine), micro_batch)]


# -- target features -----------------------------------------------------------------------------


@torch.no_grad()
def target_features(target, batch: dict[str, torch.Tensor], layer_ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """Frozen-target features of a batch: taps [B, L, n·d] (raw outputs of ``layer_ids``, -1 =
    embeddings; the same hooks as inference) and last_hidden [B, L, d] (final-norm output)."""
    taps, last = target.decoder_features(batch["input_ids"], batch["attention_mask"], layer_ids)
    return {"taps": taps, "last_hidden": last}


class FeatureCache:
    """On-disk target features, one safetensors file per sample index (``NNNN/<index>.safetensors``
    with input_ids, taps, last_hidden). ``manifest.json`` pins target, layers and dtype."""

    def __init__(self, root: str | Path, meta: dict):
        self.root = Path(root)
        manifest = self.root / "manifest.json"
        if manifest.is_file():
            found = json.loads(manifest.read_text())
            diff = sorted(k for k in meta if found.get(k) != meta[k])
            if diff:
                raise DspecError(
                    f"feature cache {root} was built with different {', '.join(diff)} "
                    f"({', '.join(f'{k}={found.get(k)!r}' for k in diff)}); use another --feature-cache directory"
                )
        else:
            ensure_folder(self.root)  # a link to a folder to be made is followed
            atomic_write_text(manifest, json.dumps({"version": 1, **meta}, indent=2) + "\n")

    def _file(self, index: int) -> Path:
        return self.root / f"{index // 4096:04d}" / f"{index}.safetensors"

    def get(self, index: int, ids: torch.Tensor) -> dict[str, torch.Tensor] | None:
        from safetensors.torch import load_file

        path = self._file(index)
        if not path.is_file():
            return None
        found = load_file(str(path))
        if not torch.equal(found["input_ids"].long(), ids.cpu().long()):
            raise DspecError(f"feature cache {self.root}: sample {index} holds other tokens (data changed?)")
        return found

    def put(self, index: int, ids: torch.Tensor, taps: torch.Tensor, last: torch.Tensor) -> None:
        from safetensors.torch import save_file

        tensors = {"input_ids": ids.to(torch.int32), "taps": taps, "last_hidden": last}
        write_atomic(self._file(index), lambda p: save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                                                             str(p)))


class Features:
    """Target features for training batches, from the cache when every sample is there."""

    def __init__(self, target, layer_ids: Sequence[int], cache: FeatureCache | None = None):
        self.target, self.layer_ids, self.cache = target, tuple(layer_ids), cache

    def __call__(self, batch: dict[str, torch.Tensor], indices: Sequence[int]) -> dict[str, torch.Tensor]:
        if self.cache is None:
            return target_features(self.target, batch, self.layer_ids)
        ids = batch["input_ids"]
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        found = [self.cache.get(i, ids[r, :n]) for r, (i, n) in enumerate(zip(indices, lengths, strict=True))]
        hits = [f for f in found if f is not None]
        if len(hits) == len(found):
            return {k: _pad([f[k] for f in hits], ids.shape[1]).to(ids.device) for k in ("taps", "last_hidden")}
        feats = target_features(self.target, batch, self.layer_ids)
        for r, (i, n) in enumerate(zip(indices, lengths, strict=True)):
            self.cache.put(i, ids[r, :n], feats["taps"][r, :n], feats["last_hidden"][r, :n])
        return feats


def _pad(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """[L_r, D] rows -> [B, width, D] zero-padded."""
    out = rows[0].new_zeros(len(rows), width, rows[0].shape[-1])
    for r, x in enumerate(rows):
        out[r, : x.shape[0]] = x
    return out

"""Target: wraps a transformers causal LM for ragged batched prefill / verify / commit.

One ``DynamicCache`` holds the whole batch (see ``target_cache``). Every forward passes
explicit per-row ``position_ids`` (committed length + offset, or + tree depth) and its own
4-D masks over all slots: rows attend to their valid cached slots and, among the new tokens,
to their causal prefix (chains) or their ancestors (trees). Models with sliding-window layers
get a ``{"full_attention": ..., "sliding_attention": ...}`` mask dict whose window is applied
on logical positions, so holes never shrink the window. Sliding layers keep their full KV
history (a plain ``DynamicCache`` never crops), which costs memory but keeps rollback exact.

Hidden taps are raw decoder-layer outputs captured with forward hooks (``-1`` = embedding
output, which for Gemma already includes the embedding scale), concatenated in
``layer_ids`` order.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from dspec_cli.checkpoints.hub import resolve_checkpoint
from dspec_cli.core.chat_template import DEFAULT_KWARGS
from dspec_cli.core.devices import auto_dtype, parse_dtype, resolve_device
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import ASSETS_DIR, DEFAULT_TARGET_PATH, embedded_path
from dspec_cli.core.hardware import warn_if_slow_half
from dspec_cli.core.ragged import flatten, to_grid
from dspec_cli.core.types import PrefillOutput, StepOutput
from dspec_cli.runtime import attention
from dspec_cli.runtime.kv_cache import (
    PendingStep,
    TargetBatch,
    ancestor_visibility,
    attention_layout,
    causal_visibility,
)

__all__ = ["ASSETS_DIR", "DEFAULT_TARGET_PATH", "PrefillOutput", "StepOutput", "Target", "TargetBatch", "embedded_path", "max_context"]

_MASKABLE = ("sdpa", attention.NAME, "eager")
_PAD_RATIO, _PAD_SLACK = 1.25, 64  # prefill groups: padded tokens <= ratio × real tokens + slack
_GROUP_TOKENS = 4096  # padded tokens per prefill forward


class Target:
    """A causal LM with a batched, ragged, rollback-able KV cache (see module docstring)."""

    def __init__(self, model, tokenizer=None, *, chat_template: bool | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config.get_text_config()
        impl = attention.attn_implementation(model)
        if impl not in _MASKABLE:
            raise ValueError(f"model attn_implementation must be one of {_MASKABLE}, got {impl!r}")
        attention.use_for(model)  # sdpa -> dspec_sdpa: no K/V copy for grouped-query heads under a mask
        self._float_mask = impl == "eager"
        self._layers = _decoder_layers(model)
        self._embed = model.get_input_embeddings()
        self._param = next(model.parameters())  # device / dtype probe (``module.to`` keeps the object)
        self._window, self._layout = attention_layout(self.config)
        params = inspect.signature(model.forward).parameters
        _check_positions(model, params)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params
        if chat_template and (tokenizer is None or tokenizer.chat_template is None):
            raise ValueError("chat_template=True but the tokenizer has no chat template")
        self.chat_template = chat_template

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        name_or_path: str | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        chat_template: bool | None = None,
    ) -> Target:
        """Load a local path or Hub id (None: the embedded default at ``DEFAULT_TARGET_PATH``).

        ``device="auto"``: cuda when available, else cpu. ``dtype="auto"``:
        :func:`~dspec_cli.core.devices.auto_dtype` (bfloat16 on CUDA and on CPUs with native bf16,
        else float32).
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer


        device = resolve_device(device)
        torch_dtype = parse_dtype(dtype)
        if torch_dtype == "auto":
            torch_dtype = auto_dtype(device) or "auto"
        if name_or_path is None:
            if not DEFAULT_TARGET_PATH.is_dir():
                raise DspecError(f"embedded default target not found at {DEFAULT_TARGET_PATH}")
            name_or_path = str(DEFAULT_TARGET_PATH)
        local = str(resolve_checkpoint(name_or_path, what="target"))  # a Hub id -> its cached snapshot
        if isinstance(torch_dtype, torch.dtype):
            warn_if_slow_half(torch_dtype, device)
        try:
            model = AutoModelForCausalLM.from_pretrained(local, dtype=torch_dtype, attn_implementation="sdpa")
            tokenizer = AutoTokenizer.from_pretrained(local)
        except (OSError, ValueError) as err:
            detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            if "scaled_dot_product_attention" in detail:  # the masks dspec passes need SDPA (or eager) attention
                detail = f"{detail.split('. ')[0]}, which dspec needs (tested: {TESTED})"
            raise DspecError(f"cannot load target {name_or_path!r}: {detail}") from err
        model.to(device).requires_grad_(False)  # pyright: ignore[reportArgumentType]  # transformers wraps `to` in a decorator pyright misreads
        if chat_template and tokenizer.chat_template is None:
            raise DspecError(f"target {name_or_path!r} has no chat template (chat_template=True)")
        try:
            return cls(model, tokenizer, chat_template=chat_template)
        except ValueError as err:  # an architecture dspec cannot run
            raise DspecError(f"cannot load target {name_or_path!r}: {err}") from None

    # -- properties ------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def max_context(self) -> int | None:
        """Most positions (prompt + generated) the target takes; None when its config states none."""
        return max_context(self.config)

    @property
    def device(self) -> torch.device:
        return self._param.device

    @property
    def dtype(self) -> torch.dtype:
        return self._param.dtype

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        sources = [getattr(self.model, "generation_config", None), self.config, self.tokenizer]
        for src in sources:
            value = getattr(src, "eos_token_id", None)
            if value is not None:
                ids.update([value] if isinstance(value, int) else value)
        return ids

    # -- prompts ---------------------------------------------------------------------------------

    def render_prompt(
        self, prompt: str | Sequence[Mapping[str, str]], chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Token ids of a prompt: chat template (with generation prompt) for chat models, else encode.

        ``chat_template_kwargs`` go to the template (default :data:`~dspec_cli.core.chat_template.DEFAULT_KWARGS`)."""
        if self.tokenizer is None:
            raise ValueError("render_prompt needs a tokenizer")
        has_template = self.tokenizer.chat_template is not None
        use_chat = has_template if self.chat_template is None else self.chat_template
        if isinstance(prompt, str):
            if not use_chat:
                return list(self.tokenizer.encode(prompt))
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = [dict(m) for m in prompt]
            if any("role" not in m or "content" not in m for m in messages):
                raise ValueError("prompt messages must be mappings with 'role' and 'content'")
            if not use_chat:
                raise ValueError("prompt is a message list but chat templating is off or missing")
        kwargs = DEFAULT_KWARGS if chat_template_kwargs is None else chat_template_kwargs
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )
        return list(ids)

    # -- batch API -------------------------------------------------------------------------------

    def new_batch(
        self, layer_ids: Sequence[int] = (), *, compact_fraction: float = 0.25, max_slots: int | None = None,
        kv_layer: type | None = None,
    ) -> TargetBatch:
        """An empty batch tapping the raw outputs of ``layer_ids`` (-1 = embedding output);
        ``kv_layer``: its cache layer class (default ``SlackLayer``)."""
        bad = [i for i in layer_ids if not -1 <= int(i) < self.num_layers]
        if bad:
            raise ValueError(f"layer_ids must be in [-1, {self.num_layers}), got {bad}")
        return TargetBatch(layer_ids, self.device, compact_fraction=compact_fraction, max_slots=max_slots,
                           kv_layer=kv_layer)

    @torch.no_grad()
    def prefill(self, batch: TargetBatch, prompts: Sequence[Sequence[int]]) -> PrefillOutput:
        """Append new requests (rows) to ``batch`` in ``prompts`` order; other rows may be mid-generation.

        Token-identical prompts run once and their rows are copied; distinct ones run in groups of
        similar length (see :func:`_length_groups`), so padding stays a bounded part of the work.
        """
        batch.require_idle("prefill")
        if not prompts or min(len(p) for p in prompts) == 0:
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        distinct: dict[tuple[int, ...], int] = {}
        which = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]  # distinct id of each prompt
        uniq = list(distinct)
        fresh = batch.empty_like(0)
        order: list[int] = []  # distinct id of each row of ``fresh``
        logits: list[torch.Tensor] = []  # [G, V] per group
        hidden: list[torch.Tensor] = []  # [L, n·d] per row of ``fresh``
        for group in _length_groups([len(u) for u in uniq]):
            part, group_logits, group_hidden = self._prefill_group(batch, [uniq[i] for i in group])
            fresh.extend(part)
            order += group
            logits.append(group_logits)
            hidden += group_hidden
        row_of = {u: r for r, u in enumerate(order)}
        index = [row_of[u] for u in which]  # row of ``fresh`` that each prompt gets
        if index != list(range(len(order))):
            fresh.select_rows(index)
        first_row = batch.num_rows
        batch.extend(fresh)
        batch.maybe_compact()
        last = torch.cat(logits).index_select(0, torch.tensor(index, device=self.device))
        rows = torch.arange(first_row, first_row + len(prompts), device=self.device)
        return PrefillOutput(logits=last, hidden=[hidden[r] for r in index], rows=rows)

    def _prefill_group(
        self, batch: TargetBatch, prompts: list[tuple[int, ...]]
    ) -> tuple[TargetBatch, torch.Tensor, list[torch.Tensor]]:
        """One left-padded forward of ``prompts`` into a fresh batch with ``batch``'s settings:
        (that batch, last-position logits [G, V] float, taps [L_g, n·d] per prompt)."""
        lens, dev = [len(p) for p in prompts], self.device
        width = max(lens)
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long, device=dev)
        start = width - torch.tensor(lens, dtype=torch.long, device=dev)  # [G] left padding
        col = torch.arange(width, device=dev)
        pos = (col[None, :] - start[:, None]).clamp(min=0)  # [G, P]
        real = col[None, :] >= start[:, None]  # [G, P]
        fresh = batch.empty_like(len(lens))
        vis = None if len(lens) == 1 else causal_visibility(real)
        logits, taps = self._forward(fresh, ids, pos, vis, last_only=True)
        fresh.record_prefill(real, pos, lens)
        return fresh, logits[:, -1].float(), [taps[r, width - n :] for r, n in enumerate(lens)]

    @torch.no_grad()
    def verify(self, batch: TargetBatch, tokens: torch.Tensor, lengths: torch.Tensor) -> StepOutput:
        """Score ragged chains appended after each row's committed prefix.

        tokens [Σn_r]: row r's n_r = ``lengths[r]`` tokens (anchor + ℓ_r drafts, so n_r = ℓ_r + 1),
        rows in order; ``lengths`` [R] may hold 0 for rows that sit this step out.
        """
        n, q, flat = self._ragged(batch, tokens, lengths)
        vis = None if self._dense(batch) else causal_visibility(self._real(n, q))
        depth = torch.arange(q, device=self.device)[None, :]
        return self._step(batch, tokens, n, q, flat, vis, depth, parents=None)

    @torch.no_grad()
    def append(self, batch: TargetBatch, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Feed and commit ragged chains in one step (verify + commit of every token, no taps).

        tokens [Σn_r], lengths [R] >= 1 as in :meth:`verify`. Returns the logits [R, V] float after
        each row's last token: what a drafter's own model needs to draft the next one.
        """
        n, q, flat = self._ragged(batch, tokens, lengths)
        if min(n) < 1:
            raise ValueError(f"append: every row needs at least one token, got lengths {n}")
        real = self._real(n, q)
        vis = None if self._dense(batch) else causal_visibility(real)
        ids = to_grid(tokens.to(self.device, torch.long), batch.num_rows, q, flat)
        pos = batch.committed[:, None] + torch.arange(q, device=self.device)  # [R, q]
        logits, _ = self._forward(batch, ids, pos, vis, last_only=flat is None)
        if flat is not None:  # ragged: each row's last real token
            logits = logits[torch.arange(len(n), device=self.device), _counts(n, self.device) - 1, None]
        batch.append_step(real, pos, n)
        return logits[:, -1].float()

    @torch.no_grad()
    def verify_tree(
        self, batch: TargetBatch, tokens: torch.Tensor, parents: torch.Tensor, lengths: torch.Tensor
    ) -> StepOutput:
        """Score ragged trees: row r has n_r = ``lengths[r]`` (lengths [R]) nodes, tokens [Σn_r], with
        row-local parents [Σn_r]: node 0 is the anchor (parent -1), node i > 0 has parent < i. Position = committed
        length + depth; each node attends to the row's valid cache and to its ancestors."""
        n, q, flat = self._ragged(batch, tokens, lengths)
        if parents.shape != tokens.shape:
            raise ValueError(f"parents must be shaped like tokens, got {tuple(parents.shape)}")
        rows, dev = batch.num_rows, self.device
        par = to_grid(parents.to(dev, torch.long), rows, q, flat, fill=-1)  # [R, q]
        col = torch.arange(q, device=dev)[None, :]
        real = col < _counts(n, dev)[:, None]
        ok = torch.where(col == 0, par == -1, (par >= 0) & (par < col))
        if not bool(torch.where(real, ok, True).all()):
            raise ValueError("parents: node 0 of a row must be -1 and node i > 0 needs 0 <= parent < i")
        vis = ancestor_visibility(par)  # [R, q, q]
        depth = vis.sum(dim=-1) - 1
        return self._step(batch, tokens, n, q, flat, vis, depth, parents=par)

    def commit(self, batch: TargetBatch, keep: torch.Tensor) -> None:
        """Chains: keep the first ``keep[r]`` verified tokens of each row [R]; the rest become holes."""
        pending = _require_pending(batch, tree=False)
        keep = keep.to(self.device, torch.long)
        keep_list = keep.tolist()
        if len(keep_list) != batch.num_rows or any(not 0 <= k <= m for k, m in zip(keep_list, pending.n, strict=True)):
            raise ValueError(f"keep must be [R] with 0 <= keep[r] <= n_r={pending.n}, got {keep_list}")
        q = batch.num_slots - pending.start
        kept = torch.arange(q, device=self.device)[None, :] < keep[:, None]
        batch.close_step(kept, keep_list)

    def commit_path(self, batch: TargetBatch, path: torch.Tensor) -> None:
        """Trees: keep the nodes of ``path`` [R, D] (row-local ids from the root down, -1 padded)."""
        pending = _require_pending(batch, tree=True)
        parents = pending.parents
        assert parents is not None  # a tree step (_require_pending)
        rows, q = parents.shape
        path = path.to(self.device, torch.long)
        if path.dim() != 2 or path.shape[0] != rows:
            raise ValueError(f"path must be [R={rows}, D], got {tuple(path.shape)}")
        used = path >= 0
        n = _counts(pending.n, self.device)
        parent = parents.gather(1, path.clamp(0, q - 1))  # [R, D]
        prev = torch.cat([torch.full_like(path[:, :1], -1), path[:, :-1]], dim=1)
        chain = (parent == prev) & (path < n[:, None])
        prefix = used.int().cummin(dim=1).values == used.int()  # -1 only as trailing padding
        ok = torch.where(used, chain, True).all() & prefix.all()
        ok, *added = torch.cat([ok[None].long(), used.sum(dim=1)]).tolist()  # one host sync
        if not ok:
            raise ValueError("path: each row must be a chain 0, child, grandchild, ... then -1 padding")
        kept = torch.zeros(rows, q + 1, dtype=torch.bool, device=self.device)
        kept.scatter_(1, torch.where(used, path, q), True)
        batch.close_step(kept[:, :q], added)

    def rollback(self, batch: TargetBatch, drop: torch.Tensor) -> None:
        """Un-commit the last ``drop[r]`` committed tokens of each row [R] (they become holes)."""
        batch.rollback(drop)

    def remove(self, batch: TargetBatch, rows: Sequence[int]) -> None:
        """Finished requests leave the batch; remaining rows keep their order."""
        batch.remove(rows)

    @torch.no_grad()
    def forward_full(
        self, ids: torch.Tensor, layer_ids: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain forward of ids [1, L] (no cache, HF's own masks): (logits [L, V] float, taps [L, n·d])."""
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(f"ids must be [1, L], got {tuple(ids.shape)}")
        with self._taps(layer_ids) as taps:
            out = self.model(input_ids=ids.to(self.device), use_cache=False)
        return out.logits[0].float(), _concat(taps, ids.shape[1], self.dtype, self.device)[0]

    # -- internals -------------------------------------------------------------------------------

    def _ragged(self, batch: TargetBatch, tokens: torch.Tensor, lengths: torch.Tensor):
        """Validate a ragged input; return n (host list), q = max n and the flat index [Σn] into
        [R*q] (None when every row has q tokens: the flat layout is the [R, q] grid itself)."""
        batch.require_idle("verify")
        rows = batch.num_rows
        if rows == 0:
            raise ValueError("verify: the batch has no rows (prefill first)")
        if lengths.dim() != 1 or lengths.shape[0] != rows:
            raise ValueError(f"lengths must be [R={rows}], got {tuple(lengths.shape)}")
        n = [int(x) for x in lengths.tolist()]
        total, q = sum(n), max(n)
        if min(n) < 0 or total == 0:
            raise ValueError(f"lengths must be >= 0 with a positive sum, got {n}")
        if tokens.dim() != 1 or tokens.shape[0] != total:
            raise ValueError(f"tokens must be [sum(lengths)={total}], got {tuple(tokens.shape)}")
        if total == rows * q:
            return n, q, None
        dev = self.device
        counts = _counts(n, dev)
        offsets = torch.arange(rows, device=dev) * q - (torch.cumsum(counts, 0) - counts)
        flat = torch.arange(total, device=dev) + torch.repeat_interleave(offsets, counts, output_size=total)
        return n, q, flat

    def _real(self, n: list[int], q: int) -> torch.Tensor:
        """[R, q] bool: slot j of row r holds one of its n[r] tokens (False: right padding)."""
        if min(n) == q:
            return torch.ones(len(n), q, dtype=torch.bool, device=self.device)
        return torch.arange(q, device=self.device)[None, :] < _counts(n, self.device)[:, None]

    @staticmethod
    def _dense(batch: TargetBatch) -> bool:
        """One row and no holes: slots equal positions, so the model's own causal mask is exact."""
        return batch.num_rows == 1 and batch.holes == 0

    def _step(self, batch, tokens, n, q, flat, vis, depth, parents) -> StepOutput:
        rows, dev = batch.num_rows, self.device
        ids = to_grid(tokens.to(dev, torch.long), rows, q, flat)
        pos = batch.committed[:, None] + depth  # [R, q]
        logits, taps = self._forward(batch, ids, pos, vis, last_only=False)
        batch.open_step(self._real(n, q), pos, PendingStep(start=batch.num_slots, n=n, parents=parents))
        out_rows = torch.repeat_interleave(torch.arange(rows, device=dev), _counts(n, dev), output_size=sum(n))
        return StepOutput(logits=flatten(logits, flat).float(), hidden=flatten(taps, flat), rows=out_rows)

    def _forward(self, batch: TargetBatch, ids, pos, vis, last_only: bool):
        """One cached forward of ids [R, q] at positions pos [R, q]; returns (logits, taps [R, q, n·d]).

        ``vis`` [R, q, q]: visibility among the new tokens, None for a dense step (one row, no
        holes, causal new tokens): slots equal positions, so the model's own causal masking is
        exact and we pass no mask (sdpa's fast path; matters at R = 1).
        """
        if vis is None:
            mask = None
        elif self._layout == "mixed":
            full, sliding = batch.attention_masks(pos, vis, self._window)
            mask = {"full_attention": self._as_mask(full), "sliding_attention": self._as_mask(sliding)}
        else:
            full, sliding = batch.attention_masks(pos, vis, self._window)
            mask = self._as_mask(sliding if self._layout == "sliding" else full)
        kwargs = {self._cache_kw: batch.cache, "attention_mask": mask, "position_ids": pos, "use_cache": True}
        if last_only and self._keep_kw:
            kwargs["logits_to_keep"] = 1
        with self._taps(batch.layer_ids) as taps:
            out = self.model(input_ids=ids, **kwargs)
        logits = out.logits[:, -1:] if last_only else out.logits
        return logits, _concat(taps, ids.shape[1], self.dtype, self.device, rows=ids.shape[0])

    def _as_mask(self, mask: torch.Tensor | None) -> torch.Tensor:
        """Bool mask for sdpa; additive float mask (0 / dtype min) for eager attention."""
        assert mask is not None  # a sliding mask exists wherever the layout has sliding layers
        if not self._float_mask:
            return mask
        return torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(self.dtype).min
        )

    @contextmanager
    def _taps(self, layer_ids: Sequence[int]) -> Iterator[list]:
        """Capture raw outputs of the tapped modules during one forward, in ``layer_ids`` order."""
        store: dict[int, torch.Tensor] = {}
        handles = []
        for lid in dict.fromkeys(int(i) for i in layer_ids):
            module = self._embed if lid == -1 else self._layers[lid]

            def hook(_mod, _inp, out, lid=lid):
                store[lid] = out[0] if isinstance(out, tuple) else out

            handles.append(module.register_forward_hook(hook))
        taps: list[torch.Tensor] = []
        try:
            yield taps
        finally:
            for h in handles:
                h.remove()
        taps.extend(store[int(i)] for i in layer_ids)


TESTED = "Qwen2, Qwen3, Llama, Mistral, Phi3, Gemma3, GPT-2, GPT-NeoX"  # docs/real-model.md "Supported targets"


def _decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder's layer list: ``get_decoder().layers`` (Llama-style) or ``.h`` (GPT-2 / Falcon)."""
    decoder = model.get_decoder()
    for name in ("layers", "h"):
        layers = getattr(decoder, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise ValueError(f"{type(model).__name__} is not a decoder dspec can run: its layers are neither at "
                     f"get_decoder().layers nor .h (tested: {TESTED})")


def _check_positions(model, params: Mapping) -> None:
    """Rows carry explicit positions (holes in the cache, tree depths): a model must take them."""
    name = type(model).__name__
    if "position_ids" not in params or getattr(model.config, "alibi", False):
        raise ValueError(f"{name} is not a decoder dspec can run: its positions come from the attention mask "
                         f"(ALiBi), not from position_ids (tested: {TESTED})")


def max_context(config) -> int | None:
    """A transformers text config's context length (``max_position_embeddings``); None when it
    states none (the config classes of some architectures lack the field)."""
    return getattr(config, "max_position_embeddings", None) or None


def _length_groups(lens: list[int]) -> list[list[int]]:
    """Indices of ``lens`` in prefill groups, longest first. Each group's padded tokens (rows ×
    its longest) stay within ``_PAD_RATIO`` × its real tokens + ``_PAD_SLACK`` and within
    ``_GROUP_TOKENS`` (bounds the [G, 1, P, P] masks; a longer prompt runs alone)."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        if groups:
            padded = (len(groups[-1]) + 1) * lens[groups[-1][0]]
            if padded <= min(_PAD_RATIO * (real + lens[i]) + _PAD_SLACK, _GROUP_TOKENS):
                groups[-1].append(i)
                real += lens[i]
                continue
        groups.append([i])
        real = lens[i]
    return groups


def _counts(n: list[int], device) -> torch.Tensor:
    """Host list of per-row counts -> long tensor [R]."""
    return torch.tensor(n, dtype=torch.long, device=device)


def _concat(taps: list[torch.Tensor], q: int, dtype, device, rows: int = 1) -> torch.Tensor:
    if not taps:
        return torch.zeros(rows, q, 0, dtype=dtype, device=device)
    return torch.cat(taps, dim=-1)


def _require_pending(batch: TargetBatch, tree: bool) -> PendingStep:
    pending = batch.pending
    if pending is None:
        raise ValueError("nothing to commit: call verify/verify_tree first")
    if (pending.parents is not None) != tree:
        want, got = ("commit_path", "verify") if tree else ("commit", "verify_tree")
        raise ValueError(f"{want} cannot follow {got}; use {'commit' if tree else 'commit_path'}")
    return pending

"""Target: wraps a transformers causal LM for the engine's static round: prefill, score, keep.

One :class:`~dspec_cli.runtime.kv_cache.SlotCache` holds the whole batch: preallocated K/V
buffers in which row r's committed tokens occupy slots 0..len_r−1 (slot = RoPE position).
Every forward writes its new tokens in place at slots len_r.. and passes explicit per-row
``position_ids`` (committed length + offset, or + tree depth) and its own 4-D masks over a
window of slots: rows attend to their committed slots and, among the new tokens, to their
causal prefix (chains) or their ancestors (trees). Models with sliding-window layers get a
``{"full_attention": ..., "sliding_attention": ...}`` mask dict whose window is applied on
positions. Sliding layers keep their full KV history, which costs memory but keeps rollback
exact.

Requests join with :meth:`Target.prefill` (host bookkeeping: rows and their lengths). A round
is static: :meth:`Target.score` runs padded grids (chains, or trees with parents) and
:meth:`Target.keep` / :meth:`Target.keep_path` keep what was accepted; they read nothing on the
host and change nothing there, so the engine can capture them as CUDA graphs
(``docs/architecture.md``); the host lengths are bounded and settled by the caller
(:meth:`TargetBatch.bound`, :meth:`TargetBatch.settle`). A drafter running its own model
(draft-model) uses :meth:`Target.append` and :meth:`Target.rollback`: score-and-keep and un-keep
with exact host lengths.

Hidden taps are raw decoder-layer outputs captured with forward hooks (``-1`` = embedding
output, which for Gemma already includes the embedding scale), concatenated in
``layer_ids`` order.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dspec_cli.checkpoints.hub import resolve_checkpoint
from dspec_cli.core.chat_template import DEFAULT_KWARGS
from dspec_cli.core.devices import auto_dtype, parse_dtype, resolve_device
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import ASSETS_DIR, DEFAULT_TARGET_PATH, embedded_path
from dspec_cli.core.hardware import warn_if_slow_half
from dspec_cli.core.types import PrefillOutput
from dspec_cli.nn.backbone import max_context
from dspec_cli.runtime import attention
from dspec_cli.runtime.decoder import WINDOW_MULTIPLE, LeanDecoder
from dspec_cli.runtime.kv_cache import (
    ForwardIO,
    TargetBatch,
    ancestor_visibility,
    attention_layout,
    attention_masks,
    causal_visibility,
    chain_mask,
)

__all__ = ["ASSETS_DIR", "DEFAULT_TARGET_PATH", "PrefillOutput", "Target", "TargetBatch", "embedded_path", "max_context"]

_MASKABLE = ("sdpa", attention.NAME, "eager")
_PAD_RATIO, _PAD_SLACK = 1.25, 64  # prefill groups: padded tokens <= ratio × real tokens + slack
_GROUP_TOKENS = 4096  # padded tokens per prefill forward


class Target:
    """A causal LM with a batched, rollback-able KV cache of one length per row (see module docstring)."""

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
        # the Llama family on a CPU runs dspec's own forward (runtime/decoder.py), others transformers'
        self._lean_unsupported = LeanDecoder.unsupported(model)
        self._lean = None if self._lean_unsupported else LeanDecoder(model)
        self._hooked: set[int] = set()  # tapped modules with a hook (kept for the target's life)
        self._store: dict[int, torch.Tensor] = {}  # tapped module -> output of the last forward
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
    def lean(self) -> bool:
        """Whether forwards run dspec's own decoder (runtime/decoder.py) rather than transformers'."""
        return self._lean is not None

    @property
    def lean_unsupported(self) -> str | None:
        """Why forwards run transformers' decoder (e.g. "device cuda"); None when they run dspec's."""
        return self._lean_unsupported

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

    # -- rows joining and leaving (host bookkeeping) ---------------------------------------------

    def new_batch(self, layer_ids: Sequence[int] = (), *, rows: int = 0, slots: int = 0,
                  batch_invariant: bool = False) -> TargetBatch:
        """An empty batch tapping the raw outputs of ``layer_ids`` (-1 = embedding output), with
        room for ``rows`` rows of ``slots`` slots (more is allocated when needed). Its forwards
        attend batch-invariantly (runtime/decoder.py; windows are multiples of WINDOW_MULTIPLE)
        when ``batch_invariant`` (dspec's own forward only; an engine passes its run's setting,
        ``GenerationConfig.batch_invariance``), else with fused attention over exact windows."""
        bad = [i for i in layer_ids if not -1 <= int(i) < self.num_layers]
        if bad:
            raise ValueError(f"layer_ids must be in [-1, {self.num_layers}), got {bad}")
        if batch_invariant and not self.lean:
            raise ValueError(f"batch-invariant forwards need dspec's own forward, not transformers' ({self.lean_unsupported})")
        return TargetBatch(layer_ids, self.device, rows, slots, window_multiple=WINDOW_MULTIPLE if batch_invariant else 1,
                           invariant=batch_invariant)

    @torch.no_grad()
    def prefill(self, batch: TargetBatch, prompts: Sequence[Sequence[int]]) -> PrefillOutput:
        """Append new requests (rows) to ``batch`` in ``prompts`` order; other rows may be mid-generation.

        Token-identical prompts run once and their rows are copied; distinct ones run in groups of
        similar length (see :func:`_length_groups`), so padding stays a bounded part of the work.
        """
        if not prompts or min(len(p) for p in prompts) == 0:
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        distinct: dict[tuple[int, ...], int] = {}
        which = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]  # distinct id of each prompt
        uniq = list(distinct)
        first = batch.num_rows
        order: list[int] = []  # distinct id of each new row
        logits: list[torch.Tensor] = []  # [G, V] per group
        hidden: list[torch.Tensor] = []  # [L, n·d] per new row
        for group in _length_groups([len(u) for u in uniq]):
            group_logits, group_hidden = self._prefill_group(batch, [uniq[i] for i in group])
            order += group
            logits.append(group_logits)
            hidden += group_hidden
        row_of = {u: r for r, u in enumerate(order)}
        index = [row_of[u] for u in which]  # new row that each prompt gets
        if index != list(range(len(order))):
            batch.select_rows(list(range(first)) + [first + i for i in index])
        last = torch.cat(logits).index_select(0, torch.tensor(index, device=self.device))
        rows = torch.arange(first, first + len(prompts), device=self.device)
        return PrefillOutput(logits=last, hidden=[hidden[r] for r in index], rows=rows)

    def _prefill_group(self, batch: TargetBatch, prompts: list[tuple[int, ...]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One left-padded forward of ``prompts`` into new rows of ``batch``: (last-position logits
        [G, V] float, taps [L_g, n·d] per prompt). The padding is then shifted out, so each row's
        slots hold positions 0.. again."""
        lens, dev = [len(p) for p in prompts], self.device
        width = max(lens)
        row0 = batch.add_rows(len(lens), width)
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long, device=dev)
        start = width - torch.tensor(lens, dtype=torch.long, device=dev)  # [G] left padding
        col = torch.arange(width, device=dev)
        pos = (col[None, :] - start[:, None]).clamp(min=0)  # [G, P]
        slots = col.expand(len(lens), width)
        masks = None
        if len(lens) > 1:
            vis = causal_visibility(col[None, :] >= start[:, None])
            masks = self._masks(torch.zeros_like(start), pos, vis, width)
        logits, taps = self._forward(batch, row0, ids, pos, slots, width, masks, last_only=True)
        if min(lens) < width:
            batch.shift_rows(row0, start, width)
        batch.commit_prefill(row0, lens)
        return logits[:, -1].float(), [taps[r, width - n :] for r, n in enumerate(lens)]

    def select_rows(self, batch: TargetBatch, index: Sequence[int]) -> None:
        """Rows become rows ``index`` of the batch, in that order (a repeated row is copied; rows not
        named leave). Only rows that change place are copied."""
        batch.select_rows(index)

    @torch.no_grad()
    def decoder_features(
        self,
        input_ids: torch.Tensor,  # [B, L]
        attention_mask: torch.Tensor,  # [B, L]
        layer_ids: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder alone (no LM head, no cache, HF's own masks) over the batch, what drafter
        training learns from: taps [B, L, n·d], the raw outputs of ``layer_ids`` (-1 = the
        embeddings) through the hooks inference uses, and last_hidden [B, L, d], the final-norm
        output."""
        self._hook(layer_ids)
        out = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        last = out.last_hidden_state
        return self._collect(layer_ids, last.shape[:2]), last

    # -- the static round: no host reads, no host bookkeeping (capturable) ------------------------

    def score(
        self, batch: TargetBatch, ids: torch.Tensor, parents: torch.Tensor | None, window: int, dense: bool = False,
        upcast: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of ids [n, q] after the committed prefix of rows [0, n) (n may exceed the
        batch's rows up to its row capacity: padding rows), attending over ``window`` slots
        (:meth:`TargetBatch.window`). ``parents`` [n, q] (row-local, -1 = none) makes each token
        see its ancestors at position committed + depth; None: causal chains. ``dense``: one row
        whose window ends at its last new token, so the model's own causal mask is exact
        (:meth:`dense`). Writes the tokens' K/V at slots committed + 0..q-1 and returns (logits
        [n, q, V] float, or in the model's dtype unless ``upcast``: no float copy for readers that
        upcast as they read, taps [n, q, n·d]); the batch's bookkeeping is unchanged."""
        rows, q = ids.shape
        committed = batch.lengths_rows(rows)
        step = torch.arange(q, device=ids.device)
        if parents is None:
            vis = None  # causal
            pos = committed[:, None] + step
        else:
            vis = ancestor_visibility(parents)  # [n, q, q]
            pos = committed[:, None] + vis.sum(-1) - 1
        slots = committed[:, None] + step
        masks = None if dense else self._masks(committed, pos, vis, window)
        logits, taps = self._forward(batch, 0, ids, pos, slots, window, masks, last_only=False)
        return logits.float() if upcast else logits, taps

    def dense(self, batch: TargetBatch, q: int, window: int) -> bool:
        """One row with an exactly known length and a window ending at its q-th new token: slots
        equal positions, so the model's own causal masking is exact and no mask is passed (sdpa's
        fast path of transformers' forward; matters at R = 1 on a CPU; the lean forward always masks)."""
        return self._lean is None and batch.num_rows == 1 and batch.exact and window == batch.bounds[0] + q

    @staticmethod
    def keep(batch: TargetBatch, keep: torch.Tensor) -> None:
        """Chains: rows [0, n) keep ``keep`` [n] of the tokens :meth:`score` wrote (no host read)."""
        batch.advance(keep)

    @staticmethod
    def keep_path(batch: TargetBatch, path: torch.Tensor) -> None:
        """Trees: rows [0, n) keep the nodes of ``path`` [n, D+1] (no host read)."""
        batch.keep_path(path)

    # -- a drafter's own model (draft-model): score and keep at once, exact host lengths ----------

    @torch.no_grad()
    def append(self, batch: TargetBatch, ids: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Score and keep one chain per row: ids [R, q], of which the first ``counts[r]`` (host ints,
        1..q) are row r's new tokens (the rest padding). Returns the logits [R, V] float after each
        row's last new token: what a draft model drafts its next token from."""
        rows, q = ids.shape
        if len(counts) != batch.num_rows or rows != batch.num_rows or not all(1 <= c <= q for c in counts):
            raise ValueError(f"append: ids [R={batch.num_rows}, q] with counts in 1..q per row, got "
                             f"{tuple(ids.shape)} and {list(counts)}")
        window = batch.window(q)
        logits, _ = self.score(batch, ids.to(self.device, torch.long), None, window, dense=self.dense(batch, q, window))
        n = torch.tensor(list(counts), dtype=torch.long, device=self.device)
        self.keep(batch, n)
        batch.settle([m + c for m, c in zip(batch.bounds, counts, strict=True)])
        return logits[torch.arange(rows, device=self.device), n - 1]

    def rollback(self, batch: TargetBatch, drop: Sequence[int]) -> None:
        """Un-keep the last ``drop[r]`` (host ints) kept tokens of each row."""
        if len(drop) != batch.num_rows or any(not 0 <= d <= m for d, m in zip(drop, batch.bounds, strict=True)):
            raise ValueError(f"drop must hold 0 <= drop[r] <= committed={batch.bounds} per row, got {list(drop)}")
        self.keep(batch, -torch.tensor(list(drop), dtype=torch.long, device=self.device))
        batch.settle([m - d for m, d in zip(batch.bounds, drop, strict=True)])

    # -- internals -------------------------------------------------------------------------------

    def _masks(self, committed, pos, vis, window: int):
        """The model's attention_mask argument: one mask, or a dict per layer type (mixed layouts).
        ``vis`` None: causal chains."""
        if vis is None:
            if self._layout == "full":
                return self._as_mask(chain_mask(committed, pos.shape[1], window))
            q = pos.shape[1]
            vis = torch.ones(q, q, dtype=torch.bool, device=pos.device).tril().expand(pos.shape[0], q, q)
        full, sliding = attention_masks(committed, pos, vis, window, self._window)
        if self._layout == "mixed":
            return {"full_attention": self._as_mask(full), "sliding_attention": self._as_mask(sliding)}
        return self._as_mask(sliding if self._layout == "sliding" else full)

    def _forward(self, batch: TargetBatch, row0: int, ids, pos, slots, window: int, masks, last_only: bool):
        """One cached forward of ids [n, q] of rows row0.. at positions pos [n, q], writing slots
        [n, q], attending over ``window`` slots under ``masks`` (None: the model's causal mask);
        returns (logits, taps [n, q, n·d])."""
        batch.cache.io = ForwardIO(row0, slots, window)
        if self._lean is not None:
            if last_only:  # a prefill: weights changed since the last one are re-read
                self._lean.sync()
            return self._lean.forward(batch.cache, ids, pos, window, masks, batch.layer_ids, last_only, batch.invariant)
        self._hook(batch.layer_ids)
        kwargs = {self._cache_kw: batch.cache, "attention_mask": masks, "position_ids": pos, "use_cache": True}
        if last_only and self._keep_kw:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids, **kwargs)
        logits = out.logits[:, -1:] if last_only else out.logits
        return logits, self._collect(batch.layer_ids, ids.shape)

    def _as_mask(self, mask: torch.Tensor | None) -> torch.Tensor:
        """Bool mask for sdpa and the lean forward; additive float mask (0 / dtype min) for eager attention."""
        assert mask is not None  # a sliding mask exists wherever the layout has sliding layers
        if not self._float_mask or self._lean is not None:
            return mask
        return torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(self.dtype).min
        )

    def _hook(self, layer_ids: Sequence[int]) -> None:
        """Forward hooks storing the raw output of each tapped module (installed once, kept)."""
        for lid in layer_ids:
            lid = int(lid)
            if lid in self._hooked:
                continue
            module = self._embed if lid == -1 else self._layers[lid]

            def hook(_mod, _inp, out, lid=lid):
                self._store[lid] = out[0] if isinstance(out, tuple) else out

            module.register_forward_hook(hook)
            self._hooked.add(lid)

    def _collect(self, layer_ids: Sequence[int], shape) -> torch.Tensor:
        """The taps of the forward just run [n, q, n·d], in ``layer_ids`` order."""
        if not layer_ids:
            return torch.zeros(*shape, 0, dtype=self.dtype, device=self.device)
        taps = torch.cat([self._store[int(i)] for i in layer_ids], dim=-1)
        self._store.clear()
        return taps


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

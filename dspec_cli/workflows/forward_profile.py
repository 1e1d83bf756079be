"""Target-forward profiling (``dspec profile-hardware`` without ``--drafter``): the target's steps
per second SPS(B) for token-batch sizes B (DSpark §3.2.2), as a :class:`~dspec_cli.core.hardware.CostTable`.

:func:`profile_sps` times one target forward of B new tokens after a context of C cached
tokens per row, for B on a grid and several C. The B tokens are laid out as
``ceil(B / row_tokens)`` rows of (nearly) equal length — the padded [rows, q] block a ragged
verify computes — and every row holds C random tokens in a ``DynamicCache`` that is cropped
back to C after each timed forward. Each point: ``warmup`` untimed forwards, then the median
and inter-quartile range of ``repeats`` timed ones (CUDA synchronised).
"""

from __future__ import annotations

import inspect
import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from dspec_cli.core.errors import DspecError
from dspec_cli.core.hardware import CostTable, device_name
from dspec_cli.runtime.target import max_context

DEFAULT_CONTEXTS = (128, 512, 2048)  # cached tokens per row profiled by default

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def profile_sps(
    model,
    *,
    grid: Sequence[int],
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    repeats: int = 10,
    warmup: int = 2,
    row_tokens: int = 8,
    model_name: str = "",
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> CostTable:
    """Profile a transformers causal LM (see module docstring). ``progress(context, B)`` after each point."""
    grid = sorted(set(int(b) for b in grid))
    contexts = sorted(set(int(c) for c in contexts))
    if not grid or grid[0] < 1:
        raise DspecError("the batch-token grid must hold integers >= 1")
    if not contexts or contexts[0] < 1:
        raise DspecError("--contexts values must be >= 1")
    if repeats < 1 or warmup < 0 or row_tokens < 1:
        raise DspecError(
            f"need --repeats >= 1, --warmup >= 0, --row-tokens >= 1; got {repeats}, {warmup}, {row_tokens}"
        )
    config = model.config.get_text_config()
    max_ctx = max_context(config)
    if max_ctx and contexts[-1] + row_tokens > max_ctx:
        raise DspecError(
            f"--contexts {contexts[-1]} plus {row_tokens} new tokens exceeds the model's context of {max_ctx}"
        )
    dev = next(model.parameters()).device
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    gen = torch.Generator().manual_seed(seed)
    vocab = config.vocab_size
    sps: dict[str, list[float]] = {}
    spread: dict[str, list[float]] = {}
    for ctx in contexts:
        prompt = torch.randint(vocab, (1, ctx), generator=gen).to(dev)
        cache = DynamicCache()
        model(input_ids=prompt, use_cache=True, **{cache_kw: cache})
        cache.batch_repeat_interleave(math.ceil(grid[-1] / row_tokens))  # all rows hold the same context
        rows_now = math.ceil(grid[-1] / row_tokens)
        medians, iqrs = {}, {}
        for b in reversed(grid):  # rows only shrink: select, never regrow
            rows = math.ceil(b / row_tokens)
            if rows < rows_now:
                cache.batch_select_indices(torch.arange(rows, device=dev))
                rows_now = rows
            q = math.ceil(b / rows)
            ids = torch.randint(vocab, (rows, q), generator=gen).to(dev)
            samples = []
            for i in range(warmup + repeats):
                _sync(dev)
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=True, **{cache_kw: cache})
                _sync(dev)
                dt = time.perf_counter() - t0
                cache.crop(-q)
                if i >= warmup:
                    samples.append(1.0 / dt)
            q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive") if repeats > 1 else samples * 3
            medians[b], iqrs[b] = statistics.median(samples), q3 - q1  # one repeat: IQR 0
            if progress is not None:
                progress(ctx, b)
        del cache
        sps[str(ctx)] = [medians[b] for b in grid]
        spread[str(ctx)] = [iqrs[b] for b in grid]
    return CostTable(
        device=dev.type,
        device_name=device_name(dev),
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        model=model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
        torch=torch.__version__,
        grid=grid,
        contexts=contexts,
        measured=sps,
        spread=spread,
        row_tokens=row_tokens,
        repeats=repeats,
        warmup=warmup,
    )

"""Target-forward profiling (``dspec profile-hardware``): SPS(B), the steps per second of the
forward the engine runs, for token-batch sizes B (DSpark §3.2.2).

For each context C and each B on the grid, the B new tokens are laid out as ceil(B / row_tokens)
rows of (nearly) equal length after C cached tokens per row (the padded [rows, q] grid a verify
step computes) and timed through the engine's own static step: :meth:`Target.score` over the
preallocated KV cache, rows padded to the engine's bucket and, on a GPU, captured once as a CUDA
graph and replayed (:mod:`dspec_cli.runtime.graphs`), so the table measures what the hardware
spends on a round rather than Python's cost per operation. Each point: ``warmup`` untimed
forwards (the first one captures), then the median and inter-quartile range of ``repeats`` timed
ones (CUDA synchronised). A forward leaves the committed lengths alone, so every repeat sees the
same context.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from dspec_cli.core.errors import DspecError
from dspec_cli.core.hardware import CostTable, device_name
from dspec_cli.runtime.engine import GenerationConfig
from dspec_cli.runtime.graphs import GraphRunner, GraphSettings
from dspec_cli.runtime.target import Target

DEFAULT_CONTEXTS = (128, 512, 2048)  # cached tokens per row profiled by default


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def profile_target(
    target: Target,
    *,
    grid: Sequence[int],
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    repeats: int = 10,
    warmup: int = 2,
    row_tokens: int = 8,
    model_name: str = "",
    seed: int = 0,
    cuda_graphs: bool = True,
    batch_invariant: bool | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> CostTable:
    """Profile ``target`` (see the module docstring); ``cuda_graphs``: capture forwards as CUDA
    graphs on a CUDA device (as the engine does); ``batch_invariant``: the engine's setting
    (GenerationConfig); ``progress(context, B)`` after each point."""
    grid = sorted({int(b) for b in grid})
    contexts = sorted({int(c) for c in contexts})
    if not grid or grid[0] < 1:
        raise DspecError("the batch-token grid must hold integers >= 1")
    if not contexts or contexts[0] < 1:
        raise DspecError("--contexts values must be >= 1")
    if repeats < 1 or warmup < 0 or row_tokens < 1:
        raise DspecError(
            f"need --repeats >= 1, --warmup >= 0, --row-tokens >= 1; got {repeats}, {warmup}, {row_tokens}"
        )
    max_ctx = target.max_context
    if max_ctx and contexts[-1] + row_tokens > max_ctx:
        raise DspecError(
            f"--contexts {contexts[-1]} plus {row_tokens} new tokens exceeds the model's context of {max_ctx}"
        )
    dev = target.device
    invariant = GenerationConfig(batch_invariant=batch_invariant).batch_invariance(target)
    graphs = GraphSettings.for_device(dev, cuda_graphs)
    runner = GraphRunner(graphs.mode)
    gen = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    sps: dict[str, list[float]] = {}
    spread: dict[str, list[float]] = {}
    for ctx in contexts:
        most = math.ceil(grid[-1] / row_tokens)
        batch = target.new_batch(rows=graphs.rows(most), slots=ctx + row_tokens + graphs.window(),
                                 batch_invariant=invariant)
        target.prefill(batch, [torch.randint(vocab, (ctx,), generator=gen).tolist()])
        target.select_rows(batch, [0] * most)  # every row holds the same context
        medians, iqrs = {}, {}
        for b in reversed(grid):  # rows only shrink
            rows = math.ceil(b / row_tokens)
            if rows < batch.num_rows:
                target.select_rows(batch, list(range(rows)))
            q = math.ceil(b / rows)
            ids = torch.randint(vocab, (rows, q), generator=gen).to(dev)
            window = batch.window(q, graphs.window())
            dense = target.dense(batch, q, window)
            padded = graphs.rows(rows)

            def step(ids, window=window, dense=dense, batch=batch):  # the engine's verify forward; outputs unread
                target.score(batch, ids, None, window, dense, upcast=dev.type == "cpu")

            samples = []
            for i in range(warmup + repeats):
                _sync(dev)
                t0 = time.perf_counter()
                runner((padded, q, window, dense, batch.generation), step, [ids], padded)
                _sync(dev)
                if i >= warmup:
                    samples.append(1.0 / (time.perf_counter() - t0))
            q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive") if repeats > 1 else samples * 3
            medians[b], iqrs[b] = statistics.median(samples), q3 - q1  # one repeat: IQR 0
            if progress is not None:
                progress(ctx, b)
        sps[str(ctx)] = [medians[b] for b in grid]
        spread[str(ctx)] = [iqrs[b] for b in grid]
    model = target.model
    return CostTable(
        device=dev.type,
        device_name=device_name(dev),
        dtype=str(target.dtype).replace("torch.", ""),
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

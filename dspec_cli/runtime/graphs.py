"""CUDA graphs of the round's static-shape device work, and the shape buckets they are captured for.

A round's device work (the drafter's propose, the target's verify forward with acceptance and
commit) is a few hundred small kernels; launched one by one from Python, a GPU waits on the host
(tens of µs per op) far longer than it computes. Captured once as a CUDA graph and replayed, the
same kernels launch as one. A graph replays fixed shapes at fixed addresses, so the engine keys
each capture by the shapes it depends on and pads to a few *buckets* (vLLM's decode graphs, one
per batch-size bucket; gpt-fast's static KV cache): rows to :func:`row_bucket`, attention windows
to multiples of :attr:`GraphSettings.window_bucket`. Everything a captured function reads or
writes besides its inputs (KV caches, lengths) must keep its storage: it is updated in place.

:class:`GraphRunner` modes: ``"cuda"`` captures on first use of a key (that call runs eagerly,
on a side stream; capture itself executes nothing) and replays after, every graph in one memory
pool, inputs and outputs in buffers outside it (see the class); ``"eager"`` just calls the
function (CPUs, ``--no-cuda-graphs``); ``"compile"`` hands each key's function to ``torch.compile(fullgraph=True)``
(on CUDA ``mode="reduce-overhead"``: fused kernels replayed as CUDA graphs; elsewhere only traced,
``backend="eager"``, which proves the function has no graph break, i.e. no host read);
``"check"`` runs eagerly through the same input and output buffers and checks on every replay that
the function touched exactly the tensors its first call did, the property a CUDA graph relies on
(CPU tests, and plugin authors checking that a drafter is capturable).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MODES", "GraphRunner", "GraphSettings", "row_bucket"]

MODES = ("eager", "cuda", "compile", "check")
_COMPILED_KEYS = 512  # specialisations torch.compile may keep per function ("compile" mode)


def row_bucket(rows: int) -> int:
    """Rows a graph is captured for: 1, 2, 4, 8, then multiples of 8 (vLLM's decode sizes)."""
    if rows <= 8:
        return 1 << max(rows - 1, 0).bit_length()
    return -(-rows // 8) * 8


@dataclass(frozen=True)
class GraphSettings:
    """How a run captures its rounds: ``mode`` (see the module docstring) and the window bucket."""

    mode: str = "eager"
    window_bucket: int = 64  # attention windows are rounded up to a multiple of this when capturing

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"graph mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.window_bucket < 1:
            raise ValueError(f"window_bucket must be >= 1, got {self.window_bucket}")

    @classmethod
    def for_device(cls, device: torch.device, cuda_graphs: bool | None = None) -> GraphSettings:
        """CUDA graphs on a CUDA device unless ``cuda_graphs`` is False; eager elsewhere."""
        on = device.type == "cuda" if cuda_graphs is None else cuda_graphs and device.type == "cuda"
        return cls("cuda" if on else "eager")

    @property
    def captures(self) -> bool:
        """Shapes are bucketed (rows padded, windows rounded up)."""
        return self.mode != "eager"

    def rows(self, rows: int) -> int:
        return row_bucket(rows) if self.captures else rows

    def window(self) -> int:
        return self.window_bucket if self.captures else 1


@dataclass
class _Entry:
    inputs: list[torch.Tensor]  # static input buffers
    outputs: Any  # what a call returns: a pytree whose tensors are the runner's output buffers
    graph: Any = None  # torch.cuda.CUDAGraph ("cuda")
    touched: frozenset[int] | None = None  # storages the first call used beyond its inputs ("check")


class GraphRunner:
    """Runs ``fn(*inputs)`` for static-shape tensor inputs, captured once per key (module docstring).

    Buffers: a call's inputs are copied into static input buffers and its outputs into output
    buffers the runner owns, both allocated outside any graph's memory pool and shared by the
    keys of one ``role`` with the same shapes (keys of a role never replay between a call and the
    use of its outputs: a round calls each role once). So all graphs share one memory pool, which
    holds only what lives inside one replay, and no replay, in whatever order graphs were
    captured, writes memory another graph's outputs live in (PyTorch's pool sharing is otherwise
    safe only when graphs replay in capture order); and a role costs one set of buffers however
    many windows and widths it is captured for (a verify step's draft probabilities: 272 MB at
    R = 64, V = 151,936). ``graph_api``: what captures and replays (``torch.cuda``; tests pass a
    CPU emulation).
    """

    def __init__(self, mode: str = "eager", graph_api: Any = None):
        if mode not in MODES:
            raise ValueError(f"graph mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self._api = torch.cuda if graph_api is None else graph_api
        self._entries: dict[Hashable, _Entry] = {}
        self._compiled: dict[Hashable, Callable[..., Any]] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}  # (role, "in" | "out", position, shape, dtype, device)
        self._pool = None
        self._side = None  # the stream warm-up calls run on
        self.captures = 0  # graphs captured so far

    def clear(self) -> None:
        """Forget every graph and buffer (state they read was reallocated): their memory is freed."""
        self._entries.clear()
        self._compiled.clear()
        self._buffers.clear()
        self._pool = None

    def __call__(self, key: Hashable, fn: Callable[..., Any], inputs: Sequence[torch.Tensor], rows: int,
                 role: Hashable = None) -> Any:
        """``fn`` of ``inputs`` (each [n, ...], n <= rows) zero-padded along dimension 0 to ``rows`` (a bucket); returns what
        ``fn`` returns. Under "cuda" and "check" a call returns the output buffers of ``role``
        (default: the key itself): use them before the next call of that role. ``fn`` must not
        keep its inputs past the call (the buffers are shared)."""
        if self.mode == "eager":
            return fn(*(_pad(x, rows) for x in inputs))
        if self.mode == "compile":
            return self._compile(key, fn, inputs)(*(_pad(x, rows) for x in inputs))
        role = key if role is None else role
        entry = self._entries.get(key)
        if entry is None:
            static = [self._buffer((role, "in", i), (rows, *x.shape[1:]), x) for i, x in enumerate(inputs)]
            _fill(static, inputs)
            if self.mode == "cuda":
                entry = self._capture(role, fn, static)
            else:  # like "cuda": this call runs as is; the first replay records what a capture would see
                entry = _Entry(static, self._own(role, fn(*static)))
            self._entries[key] = entry
            self.captures += 1
            return entry.outputs
        _fill(entry.inputs, inputs)
        if self.mode == "cuda":
            entry.graph.replay()
            return entry.outputs
        with _Touched() as touched:
            fresh = fn(*entry.inputs)
        again = touched.storages(entry.inputs)
        if entry.touched is None:
            entry.touched = again
        elif again != entry.touched:
            new = ", ".join(touched.describe(p) for p in sorted(again - entry.touched)[:4])
            raise RuntimeError(f"graph {key!r}: a replay used tensors its capture did not (e.g. {new}): "
                               "state it reads was reallocated, or is made anew outside the graph")
        _copy_leaves(entry.outputs, fresh)
        return entry.outputs

    def _compile(self, key: Hashable, fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> Callable[..., Any]:
        compiled = self._compiled.get(key)
        if compiled is None:
            # every key compiles the same code object anew: allow a specialisation per key
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _COMPILED_KEYS)
            if inputs[0].device.type == "cuda":
                compiled = torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead")
            else:
                compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend="eager")
            self._compiled[key] = compiled
            self.captures += 1
        return compiled

    def _capture(self, role: Hashable, fn: Callable[..., Any], static: list[torch.Tensor]) -> _Entry:
        """Run ``fn`` once on a side stream (PyTorch's advice before a capture: lazy initialisations
        happen outside it), then capture it followed by the copy of its outputs into the role's
        output buffers (the capture executes nothing: this call's outputs are the run's)."""
        api = self._api
        if self._side is None:
            self._side = api.Stream()
        self._side.wait_stream(api.current_stream())
        with api.stream(self._side):
            out = fn(*static)
        api.current_stream().wait_stream(self._side)  # later side-stream work waits for the copy below
        outputs = self._own(role, out)
        if self._pool is None:
            self._pool = api.graph_pool_handle()
        graph = api.CUDAGraph()
        with api.graph(graph, pool=self._pool):
            _copy_leaves(outputs, fn(*static))
        return _Entry(static, outputs, graph=graph)

    def _buffer(self, name: tuple, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        """The buffer ``name`` (role, kind, position) of ``shape`` and ``like``'s dtype and device."""
        key = (*name, tuple(shape), like.dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return buf

    def _own(self, role: Hashable, out: Any) -> Any:
        """``out`` with each tensor copied into the role's output buffer of its position."""
        leaves, spec = pytree.tree_flatten(out)
        owned = [self._buffer((role, "out", i), x.shape, x).copy_(x) if isinstance(x, torch.Tensor) else x
                 for i, x in enumerate(leaves)]
        return pytree.tree_unflatten(owned, spec)


def _fill(static: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
    """Copy each input [n, ...] into its buffer [rows, ...] and zero the rows past n."""
    for buf, x in zip(static, inputs, strict=True):
        buf[: x.shape[0]].copy_(x)
        if x.shape[0] < buf.shape[0]:
            buf[x.shape[0] :].zero_()


def _copy_leaves(dst: Any, src: Any) -> None:
    """Copy the tensors of pytree ``src`` into those of ``dst`` (same structure)."""
    for old, new in zip(pytree.tree_leaves(dst), pytree.tree_leaves(src), strict=True):
        if isinstance(old, torch.Tensor):
            old.copy_(new)


def _pad(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x zero-padded along dimension 0 to ``rows``."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


class _Touched(TorchDispatchMode):
    """Storages an eager call reads or writes that it did not allocate itself."""

    def __init__(self) -> None:
        super().__init__()
        self._made: set[int] = set()
        self._used: dict[int, str] = {}  # storage -> what first used it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default:  # a constant made by this call (torch.tensor, x[i] = 1)
            self._made.update(_storages(args))
        for ptr, x in _storages((args, kwargs or {})).items():
            if ptr not in self._made and ptr not in self._used:
                self._used[ptr] = f"{func.__name__} of {x.dtype} {tuple(x.shape)}".replace("torch.", "")
        out = func(*args, **(kwargs or {}))
        self._made.update(ptr for ptr in _storages(out) if ptr not in self._used)
        return out

    def storages(self, inputs: Sequence[torch.Tensor]) -> frozenset[int]:
        """Storages the recorded calls touched besides those of ``inputs`` (tensors [...] of any shape)."""
        return frozenset(set(self._used) - set(_storages(list(inputs))))

    def describe(self, ptr: int) -> str:
        return self._used[ptr]


def _storages(tree) -> dict[int, torch.Tensor]:
    """The tensors in ``tree`` by storage address (opaque tensors, e.g. oneDNN-packed weights,
    have none)."""
    out = {}
    for x in pytree.tree_leaves(tree):
        if isinstance(x, torch.Tensor) and x.numel() and x.layout == torch.strided and not x.is_mkldnn:
            out.setdefault(x.untyped_storage().data_ptr(), x)
    return out

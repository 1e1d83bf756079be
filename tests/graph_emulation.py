"""The CUDA graph API emulated on a CPU, for tests of GraphRunner's "cuda" mode.

A capture records every aten op the captured code dispatches; a replay runs the recorded ops
again, in order, on the same tensors from outside the capture (caches, input and output buffers)
and on fresh results for the tensors the capture made, so, as on a GPU, no Python of the
captured code runs at replay (a host value read at capture would be baked in: reading one
inside a capture raises, as CUDA does). A CUDA capture executes nothing; this one runs the ops
to record them, then puts back every tensor from outside that they wrote. Tensors a capture
allocates are this emulation's "memory pool": :attr:`EmulatedGraphs.pool` holds their storages.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class _Recorder(TorchDispatchMode):
    def __init__(self, pool: set[int]) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.pool = pool
        self._outside: set[int] = set()  # storages of tensors the capture did not make
        self._before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # outside storage written -> (bytes, copy)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("a host read inside a captured CUDA graph")
        for x in pytree.tree_leaves((args, kwargs)):
            ptr = _storage(x)
            if ptr is not None and ptr not in self.pool:
                self._outside.add(ptr)
        for i, arg in enumerate(func._schema.arguments):
            x = args[i] if i < len(args) else kwargs.get(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write and _storage(x) is not None:
                self._keep(x)
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        for x in pytree.tree_leaves(out):
            ptr = _storage(x)
            if ptr is not None and ptr not in self._outside:
                self.pool.add(ptr)
        return out

    def _keep(self, x: torch.Tensor) -> None:
        """Save the storage of ``x`` before its first write, unless the capture made it."""
        ptr = _storage(x)
        if ptr not in self.pool and ptr not in self._before:
            whole = torch.empty(0, dtype=torch.uint8, device=x.device).set_(x.untyped_storage())
            self._before[ptr] = whole, whole.clone()

    def undo(self) -> None:
        """Put back what the recorded ops wrote outside the capture."""
        for whole, saved in self._before.values():
            whole.copy_(saved)


def _storage(x) -> int | None:
    """The storage address of a tensor with elements and a storage (not oneDNN's opaque ones)."""
    if isinstance(x, torch.Tensor) and x.numel() and x.layout == torch.strided and not x.is_mkldnn:
        return x.untyped_storage().data_ptr()
    return None


class _Graph:
    def __init__(self) -> None:
        self.ops: list[tuple] = []

    def replay(self) -> None:
        fresh: dict[int, torch.Tensor] = {}  # id of a tensor the capture made -> this replay's

        def now(x):
            return fresh.get(id(x), x) if isinstance(x, torch.Tensor) else x

        for func, args, kwargs, out in self.ops:
            result = func(*pytree.tree_map(now, args), **pytree.tree_map(now, kwargs))
            for old, new in zip(pytree.tree_leaves(out), pytree.tree_leaves(result), strict=True):
                if isinstance(old, torch.Tensor):
                    fresh[id(old)] = new


class _Stream:
    def wait_stream(self, other) -> None:
        pass


class EmulatedGraphs:
    """What GraphRunner uses of ``torch.cuda``, on a CPU."""

    def __init__(self) -> None:
        self.pool: set[int] = set()  # storages allocated inside captures
        self.captured = 0

    def Stream(self) -> _Stream:  # noqa: N802 - torch.cuda's name
        return _Stream()

    def current_stream(self) -> _Stream:
        return _Stream()

    @contextmanager
    def stream(self, _stream):
        yield

    def graph_pool_handle(self) -> object:
        return object()

    def CUDAGraph(self) -> _Graph:  # noqa: N802 - torch.cuda's name
        return _Graph()

    @contextmanager
    def graph(self, graph: _Graph, pool=None):
        with _Recorder(self.pool) as recorder:
            yield
        recorder.undo()
        graph.ops = recorder.ops
        self.captured += 1

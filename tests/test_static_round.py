"""The engine's static-shape round: one host read per round, capturable device work (no graph
break under torch.compile(fullgraph=True), the same tensors on every replay), rows padded to
buckets, and the same tokens as before the rounds became static."""

from __future__ import annotations

import functools
import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

from dspec_cli.core.host import device_path, reads_free
from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine, _fill_holes
from dspec_cli.runtime.graphs import GraphRunner, row_bucket
from dspec_cli.runtime.target import Target
from dspec_cli.testing.host_reads import count_host_reads
from tests.tiny_models import tiny_target

DATA = Path(__file__).parent / "data"


def build(name: str, target: Target):
    """A random drafter: 2 layers, γ = 4, rank-16 heads, seeded."""
    cls = get_drafter_class(name)
    torch.manual_seed(1)
    return cls.build(cls.config_class(block_size=4, num_layers=2, markov_rank=16), target)


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny_target("qwen3", seed=0)


@pytest.fixture(scope="module")
def drafters(target):
    dspark = build("dspark-markov", target)
    ddtree_cls = get_drafter_class("ddtree")
    ddtree = ddtree_cls(ddtree_cls.config_class(tree_budget=6), target, dspark)
    return {"plain": None, "dspark-markov": dspark, "ddtree": ddtree}


PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 8, 9], [100, 3, 64, 64, 12, 1, 5, 77, 2]]


def _run(target, drafter, *, temperature: float, max_batch: int, graphs: str = "eager", engine=None,
         prompts=PROMPTS, max_new_tokens: int = 10, **sampling):
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, block_size=4, max_batch=max_batch,
                           seed=3, graphs=graphs, **sampling)
    engine = engine or SpeculativeEngine(target, drafter, cfg, stop_ids=[])
    return [r.output_ids for r in engine.generate(prompts)], engine


# the verification rule of each drafter's rounds under the default GenerationConfig, by temperature
DEFAULT_RULES = {"plain": {0.0: set(), 1.0: set()}, "dspark-markov": {0.0: {"greedy"}, 1.0: {"block"}},
                 "ddtree": {0.0: {"match"}, 1.0: {"sampled"}}}


TOP_K_P = {"top_k": 8, "top_p": 0.9}


@pytest.mark.parametrize("name", ["plain", "dspark-markov", "ddtree"])
@pytest.mark.parametrize("temperature,sampling", [(0.0, {}), (1.0, {}), (1.0, TOP_K_P)], ids=["T0", "T1", "top-k-p"])
def test_one_host_read_per_round(target, drafters, name, temperature, sampling, monkeypatch):
    """On the code paths a GPU runs, a round reads the device once (the accepted tokens), at
    R = 1 and with continuous batching (rows joining, leaving, padded to a bucket); no host data
    is copied to the device inside a round (top-k and top-p included: a copy would break CUDA
    graph capture). The rounds verify by the default rules: block verification of dspark's
    chains, recursive rejection over ddtree's sampled trees (T = 1)."""
    reads: list[int] = []
    live: list = []  # the running counter, read by the patched round
    real = SpeculativeEngine._round

    def counted(self, rows, results):
        before = live[0].total if live else 0
        real(self, rows, results)
        reads.append((live[0].total if live else 0) - before)

    monkeypatch.setattr(SpeculativeEngine, "_round", counted)
    for max_batch in (1, 3):
        with device_path():
            _, engine = _run(target, drafters[name], temperature=temperature, max_batch=max_batch, **sampling)  # warm
        reads.clear()
        with count_host_reads() as counter:
            live.append(counter)
            _run(target, drafters[name], temperature=temperature, max_batch=max_batch, engine=engine, **sampling)
        live.clear()
        assert reads and max(reads) == 1, (max_batch, reads, counter.sites.most_common(5))
        assert set(engine.stats.verify_rules) == DEFAULT_RULES[name][temperature]


def _same_tokens(target, drafter, graphs: str, temperatures=(0.0, 1.0), **run) -> None:
    run = {"max_batch": 2, **run}
    with device_path():
        for temperature in temperatures:
            want, _ = _run(target, drafter, temperature=temperature, **run)
            got, engine = _run(target, drafter, temperature=temperature, graphs=graphs, **run)
            assert got == want, (graphs, temperature)
            assert engine._session.runner.captures > 0


@pytest.mark.parametrize("name", ["plain", "dspark-markov", "ddtree"])
def test_replays_touch_the_tensors_their_capture_did(target, drafters, name):
    """In "check" mode every step the engine would capture (the drafter's propose and advance, the
    target's verify forward with acceptance and commit) runs through static input buffers, and
    each replay touches exactly the tensors its first run did (what a CUDA graph needs); the
    tokens are the eager ones, at T = 0 and T = 1, with rows padded to a bucket."""
    _same_tokens(target, drafters[name], "check")


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fused"])
def test_round_compiles_without_graph_breaks(target, drafters, invariant, monkeypatch):
    """The same steps trace under torch.compile(fullgraph=True): no graph break, so no host read
    (dspark's chain at T = 1, one request, traced only; the other drafters, T = 0 and batches,
    compiled by inductor, in the slow suite), with either attention of dspec's own forward."""
    monkeypatch.setattr("dspec_cli.runtime.graphs.CPU_COMPILE_BACKEND", "eager")
    _same_tokens(target, drafters["dspark-markov"], "compile", temperatures=(1.0,), max_batch=1, prompts=PROMPTS[:1],
                 max_new_tokens=8, batch_invariant=invariant)


def test_fused_attention_replays_touch_the_tensors_their_capture_did(target, drafters):
    """With batch invariance off (fused attention over exact windows) the steps are as capturable."""
    _same_tokens(target, drafters["dspark-markov"], "check", batch_invariant=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "dspark-markov", "ddtree"])
def test_every_round_compiles_without_graph_breaks(target, drafters, name):
    _same_tokens(target, drafters[name], "compile")


@pytest.mark.parametrize("name", ["plain", "dspark-markov", "ddtree"])
def test_a_run_reserves_its_windows_and_captures_each_shape_once(target, drafters, name, monkeypatch):
    """A run's caches are reserved for its widest attention window (the longest prompt + the new
    tokens + the widest verify, rounded up to the window bucket; here the last rounds' windows
    pass the first 64-slot bucket), so no round reallocates a cache (which would re-key, and
    recapture, every graph); a second run of the same shapes captures nothing; a run that needs
    more room frees the graphs captured over the old buffers."""
    seen: list[tuple] = []
    real = SpeculativeEngine._round

    def watched(self, rows, results):
        real(self, rows, results)
        seen.append((rows.batch.generation, None if rows.dstate is None else rows.dstate.cache.generation))

    monkeypatch.setattr(SpeculativeEngine, "_round", watched)
    prompts = [list(range(3, 3 + n)) for n in (50, 31, 44)]
    run = dict(temperature=1.0, max_batch=3, max_new_tokens=12, prompts=prompts)
    with device_path():
        want, _ = _run(target, drafters[name], **run)
        got, engine = _run(target, drafters[name], graphs="check", **run)
        assert got == want and len(set(seen)) == 1, sorted(set(seen))
        runner = engine._session.runner
        captured = runner.captures
        _run(target, drafters[name], graphs="check", engine=engine, **run)
        assert runner.captures == captured and runner._entries
        engine._rows(longest_prompt=200)  # the next run needs more room: the caches grow
        assert not runner._entries


@pytest.mark.parametrize("name", ["plain", "dspark-markov", "ddtree"])
def test_cuda_mode_gives_the_eager_tokens_with_outputs_outside_the_graph_pool(target, drafters, name, monkeypatch):
    """"cuda" mode's capture and replay on a CPU emulation of CUDA graphs (tests/graph_emulation.py:
    a replay runs the captured ops only, no Python) give the eager tokens, T = 0 and 1, rows
    padded to a bucket; and no tensor the runner returns lives in the graphs' shared memory pool,
    so no graph's replay, in whatever order, writes another graph's outputs."""
    from dspec_cli.runtime import engine as engine_mod
    from dspec_cli.runtime.graphs import GraphSettings
    from tests.graph_emulation import EmulatedGraphs

    emulated = EmulatedGraphs()
    monkeypatch.setattr(engine_mod, "GraphRunner", functools.partial(GraphRunner, graph_api=emulated))
    with device_path():
        for temperature in (0.0, 1.0):
            want, _ = _run(target, drafters[name], temperature=temperature, max_batch=3)
            engine = SpeculativeEngine(target, drafters[name], GenerationConfig(
                max_new_tokens=10, temperature=temperature, block_size=4, max_batch=3, seed=3), stop_ids=[])
            engine.graphs = GraphSettings("cuda")  # the CUDA path, on the emulation
            assert [r.output_ids for r in engine.generate(PROMPTS)] == want, temperature
            runner = engine._session.runner
            assert runner.captures == emulated.captured > 0
            owned = {x.untyped_storage().data_ptr() for entry in runner._entries.values()
                     for x in pytree.tree_leaves(entry.outputs) if isinstance(x, torch.Tensor) and x.numel()}
            assert owned and not owned & emulated.pool
            emulated.captured = 0


@pytest.mark.parametrize("graphs", ["eager", "check"])
def test_a_dropped_engine_frees_its_caches_at_once(target, drafters, graphs):
    """No reference cycle holds an engine's KV caches: dropping the engine frees them without the
    cycle collector (a GPU's memory comes back when the engine goes)."""
    engine = _run(target, drafters["dspark-markov"], temperature=1.0, max_batch=2, graphs=graphs)[1]
    refs = [weakref.ref(engine._session.batch.cache.layers[0].keys), weakref.ref(engine._session.dstate.cache._keys[0])]
    gc.collect()
    gc.disable()
    try:
        del engine
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()


def test_check_mode_catches_state_made_anew_each_round(target, drafters, monkeypatch):
    """A drafter whose propose reads state reallocated between rounds could not be replayed as a
    graph: "check" mode says so."""
    drafter = drafters["dspark-markov"]
    real = type(drafter).propose

    def fresh_cache(self, state, anchors, max_len, sampler):
        cache = state.cache
        cache._keys = [t.clone() for t in cache._keys]  # new storage every round
        return real(self, state, anchors, max_len, sampler)

    monkeypatch.setattr(type(drafter), "propose", fresh_cache)
    with device_path(), pytest.raises(RuntimeError, match="reallocated"):
        _run(target, drafter, temperature=1.0, max_batch=1, graphs="check")


def test_greedy_tokens_match_the_engine_before_static_rounds():
    """The embedded target (float32): plain decoding and dspark's greedy outputs are token for
    token what the engine gave before its rounds became static (recorded), at R = 1 and R = 2."""
    ref = json.loads((DATA / "greedy_embedded.json").read_text())
    target = Target.load(None, dtype="float32")
    dspark = get_drafter_class("dspark-markov").load_default(target)
    n = 24
    want = [o[:n] for o in ref["outputs"][:2]]
    for drafter, max_batch in ((None, 1), (dspark, 2)):
        cfg = GenerationConfig(max_new_tokens=n, temperature=0.0, max_batch=max_batch)
        got = [r.output_ids for r in SpeculativeEngine(target, drafter, cfg).generate(ref["prompts"][:2])]
        assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_give_the_eager_tokens():  # pragma: no cover - GPU machines
    """Against "check": the same padded shapes run eagerly, so the same kernels (exact-shape eager
    rounds may pick other GEMM kernels, which can move a near tie)."""
    target = Target(tiny_target("qwen3").model.cuda())
    for name in ("plain", "dspark-markov", "ddtree"):
        drafter = None if name == "plain" else build("dspark-markov", target)
        if name == "ddtree":
            cls = get_drafter_class("ddtree")
            drafter = cls(cls.config_class(tree_budget=6), target, drafter)
        for temperature, sampling in ((0.0, {}), (1.0, {}), (1.0, TOP_K_P)):
            want, _ = _run(target, drafter, temperature=temperature, max_batch=3, graphs="check", **sampling)
            got, engine = _run(target, drafter, temperature=temperature, max_batch=3, graphs="cuda", **sampling)
            assert got == want and engine._session.runner.captures > 0, (name, temperature, sampling)


def test_row_buckets_and_hole_filling():
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64)] == [1, 2, 4, 4, 8, 8, 16, 16, 24, 64]
    # rows 1 and 3 of 6 finish: the last rows fill the holes (only they move); the drafter's rows
    # (first 4) stay before the pending admissions
    assert _fill_holes(6, {1, 3}, admitted=6) == [0, 4, 2, 5]
    assert _fill_holes(6, {1, 3}, admitted=4) == [0, 2, 4, 5]
    assert _fill_holes(5, {0}, admitted=2) == [1, 4, 2, 3]
    assert _fill_holes(3, {0, 1, 2}, admitted=3) == []


def test_graph_runner_pads_rows_and_checks_replays():
    """Inputs are zero-padded to the bucket; "check" calls reuse the input and output buffers (the
    keys of one role share them) and notice state reallocated between calls."""
    state = {"w": torch.ones(4)}

    def fn(x):
        return (x * state["w"][: x.shape[0]]).sum(0, keepdim=True), x.shape[0]

    eager = GraphRunner("eager")
    assert eager("k", fn, [torch.ones(3)], 4) == (torch.tensor([3.0]), 4)
    check = GraphRunner("check")
    first = check("k", fn, [torch.ones(3)], 4)[0]
    assert first.item() == 3.0
    second = check("k", fn, [torch.full((2,), 2.0)], 4)[0]  # records what a capture would see
    assert second is first and second.item() == 4.0
    assert check("k", fn, [torch.full((1,), 5.0)], 4)[0] is first and first.item() == 5.0
    other = check("k2", fn, [torch.ones(2)], 4, role="k")[0]  # another key of the role: the same buffers
    assert other is first and first.item() == 2.0 and check.captures == 2
    state["w"] = torch.ones(4)  # reallocated: a graph would read the old one
    with pytest.raises(RuntimeError, match="reallocated"):
        check("k", fn, [torch.ones(1)], 4)


def test_reads_free_only_on_a_cpu_outside_device_path():
    x = torch.zeros(1)
    assert reads_free(x)
    with device_path():
        assert not reads_free(x) and not reads_free(torch.device("cpu"))
    assert not reads_free(torch.device("meta"))

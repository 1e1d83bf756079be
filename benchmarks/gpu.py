"""GPU benchmark (not a test): every figure of dspec's GPU goals, in one JSON, within a time budget.

    python -m benchmarks.gpu --json OUT.json --budget 300 [--device cuda] [--small] [--parts a,b,...]

Builds a random-init Qwen3-4B-shaped target in memory (bf16, vocabulary 151,936; no download;
``--small`` a two-layer toy for a CPU dry run) and runs the parts below, most valuable first,
each in its own process within what ``--budget`` has left (benchmarks/budget.py): the JSON is
rewritten after every part, a part keeps what it measured when it is stopped, and a failed part
keeps the tail of its output (its traceback) under ``errors``.

* ``correct``: CUDA graphs give the tokens of the same static rounds run eagerly ("check" mode:
  same shapes, no graphs; CPU: "check" against "eager"), for plain decoding, dspark and ddtree at
  T = 0, 1 and with top-k / top-p, on the embedded target; and the Triton verifiers' tokens
  against the torch reference at R = 64, V = 151,936 (from probabilities; from bf16 logits);
* ``plain``: a plain decode step through dspec's engine at B = 1, 16, 64 and T = 0, 1 (context
  512), against the bound = (weight bytes + KV bytes read per step) / read bandwidth, with and
  without CUDA graphs at B = 1; one verify forward of 1, 8, 16, 32 tokens per row at B = 1 (the
  engine's captured step) against a one-token one; then B = 64 at context 4,096 (the KV
  reserve, peak memory);
* ``syncs``: host synchronisations per round of the engine (CUDA sync-debug mode; on a CPU the
  host reads :func:`dspec_cli.testing.host_reads.count_host_reads` counts), plain, dspark and
  ddtree at T = 0 and 1, on the embedded target;
* ``kernels``: verification at R = 1 and 64, γ = 7, V = 151,936 on the padded grid the engine
  runs, each call captured alone as a CUDA graph over fixed tensors (no input copies), against a
  captured read of the same tensor: token and block rules, one-hot drafts and greedy from fp32
  probabilities; token and block rules from the bf16 logits (what the engine's verify runs on
  CUDA) against the path they replace (fp32 copy, softmax, verification of the probabilities);
* ``embedded``: the embedded target, dspark and ddtree against plain decoding at R = 1 and 64;
* ``attention``: one layer's masked attention of one query token at B = 1, contexts 512 and
  4,096 (the target's stacked grouped-query layout), against reading its K/V; and the drafter's
  block attention, stacked against ``enable_gqa`` under a mask;
* ``profile``: ``profile-hardware``'s curve (the engine's captured forward) at 1, 8, 64, 512,
  1,024 batch tokens, context 512, with its bound;
* ``bandwidth``: the device's read and copy bandwidth (``plain`` measures it too).

``goals`` sums up each figure against its target (met / missed). Times are medians of timed
repetitions after warm-up, CUDA synchronised.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.budget import (
    GRACE,
    Outcome,
    Part,
    Progress,
    launch,
    run_parts,
    write_json,
)

CONTEXT = 512
PARTS = (  # most valuable first; caps fit a 300 s budget with each part's start-up (~10 s on a GPU, the 4B model ~5 s)
    Part("correct", 60), Part("plain", 90, least=30), Part("syncs", 40), Part("kernels", 45), Part("embedded", 70),
    Part("attention", 25), Part("profile", 50, least=30), Part("bandwidth", 20),
)
SMALL = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             vocab_size=8192, max_position_embeddings=8192, num_hidden_layers=2, tie_word_embeddings=True)


# -- helpers ------------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, warmup: int = 3, repeats: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def captured_ms(fn, device: torch.device) -> float:
    """Median ms of ``fn()`` replayed as one CUDA graph over the tensors it closes over (no
    input copies: the work itself); on a CPU, of ``fn()``."""
    if device.type != "cuda":
        return median_ms(fn, device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up: kernels compiled and chosen outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, device)


def build_target(args):
    """The random-init Qwen3-4B-shaped target (``--small``: a two-layer toy)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from benchmarks.drafter_latency import SHAPES
    from dspec_cli.runtime.target import Target

    fields = SMALL if args.small else SHAPES["qwen3-4b"][0]
    dtype = torch.float32 if args.small else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**fields, attn_implementation="sdpa"), dtype=dtype)
    return Target(model.eval().requires_grad_(False))


def embedded_target(args):
    from dspec_cli.runtime.target import Target

    return Target.load(None, device=args.device, dtype="bfloat16" if args.device != "cpu" else "float32")


def kv_bytes_per_token(target) -> int:
    cfg = target.config
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * target.dtype.itemsize


def bound_ms(target, rows: int, context: int, read_bps: float) -> float:
    """Bytes a decode step must read (every weight once, each row's KV cache) over ``read_bps``."""
    weights = sum(p.numel() * p.element_size() for p in target.model.parameters())
    return 1e3 * (weights + kv_bytes_per_token(target) * context * rows) / read_bps


def read_bandwidth(device: torch.device) -> dict:
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    x = torch.randn(n, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    read_ms = median_ms(lambda: torch.sum(x, dtype=torch.float32), device)
    copy_ms = median_ms(lambda: y.copy_(x), device)
    nbytes = x.numel() * x.element_size()
    return {"read_TBps": nbytes / read_ms / 1e9, "copy_TBps": 2 * nbytes / copy_ms / 1e9, "bytes": nbytes}


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(16, vocab - 16, (length,), generator=g).tolist() for _ in range(n)]


def engine_round_ms(target, drafter, rows: int, temperature: float, graphs: str, new_tokens: int, prompts) -> dict:
    """ms per round of the engine after a warm-up run on the same engine (graphs captured)."""
    from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine

    cfg = GenerationConfig(max_new_tokens=new_tokens, temperature=temperature, max_batch=rows, seed=0, graphs=graphs)
    engine = SpeculativeEngine(target, drafter, cfg, stop_ids=())
    engine.generate(prompts)  # warm: kernels chosen, graphs captured
    engine.stats = type(engine.stats)()
    sync(target.device)
    t0 = time.perf_counter()
    results = engine.generate(prompts)
    sync(target.device)
    wall = time.perf_counter() - t0
    st = engine.stats
    tokens = sum(len(r.output_ids) for r in results)
    return {"ms_per_round": 1e3 * (wall - st.prefill_seconds) / max(st.rounds, 1), "rounds": st.rounds,
            "tokens_per_s": tokens / wall, "tau": tokens / max(st.rounds * rows, 1) if drafter else 1.0,
            "captures": engine._session.runner.captures if engine._session else 0}


def _memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"peak_GB": torch.cuda.max_memory_allocated(device) / 1e9, "total_GB": torch.cuda.mem_get_info(device)[1] / 1e9}


# -- parts ----------------------------------------------------------------------------------------

def part_correct(args, progress: Progress) -> dict:
    from dspec_cli.checkpoints import load_drafter
    from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine

    target = embedded_target(args)
    prompts = [target.render_prompt(p) for p in ("What is 12 times 7?", "Write a haiku about rain.", "def fib(n):")]
    graphs, against = ("cuda", "check") if args.device.startswith("cuda") else ("check", "eager")
    out: dict = {"graphs": graphs, "against": against, "runs": [], "kernels": []}
    for name in ("plain", "dspark-markov", "ddtree"):
        drafter = None if name == "plain" else load_drafter(name, target)
        for settings in (dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_k=20, top_p=0.9)):
            if progress.left() < 5:
                return progress.save(out)
            tokens = []
            for mode in (against, graphs):
                cfg = GenerationConfig(max_new_tokens=24, max_batch=3, seed=0, graphs=mode, **settings)
                tokens.append([r.output_ids for r in SpeculativeEngine(target, drafter, cfg, stop_ids=()).generate(prompts)])
            out["runs"].append({"drafter": name, **settings, "same_tokens": tokens[0] == tokens[1]})
            print("correct", out["runs"][-1], flush=True)
            progress.save(out)
    if args.device.startswith("cuda"):
        out["kernels"] = _kernel_agreement(torch.device(args.device))
    return progress.save(out)


def _kernel_agreement(dev: torch.device) -> list[dict]:
    """Triton against the torch reference on the padded grid, R = 64, γ = 7, V = 151,936: equal
    tokens from probabilities (bit for bit by design), the share of equal rows from bf16 logits
    (equal except where two candidates are within rounding)."""
    from dspec_cli.core.sampling import CounterNoise
    from dspec_cli.runtime.verify import verify_chain_grid, verify_chain_logits_grid

    x = _verify_inputs(64, 7, 151_936, dev)
    noise = CounterNoise(x["seeds"], x["offsets"], 2)
    out = []
    for method in ("token", "block"):
        for q in (x["q"], None):
            kw = dict(method=method, uniforms=x["u"], noise=noise)
            runs = [verify_chain_grid(x["probs"], x["drafts"], q, x["ell"], backend=b, **kw) for b in ("torch", "triton")]
            logits = [verify_chain_logits_grid(x["logits"], x["drafts"], q, x["ell"], temperature=1.0, backend=b, **kw)
                      for b in ("torch", "triton")]
            same = (logits[0].tokens == logits[1].tokens).all(1).float().mean().item()
            out.append({"method": method, "one_hot": q is None, "probs_equal": bool(torch.equal(runs[0].tokens, runs[1].tokens)),
                        "logits_rows_equal": same})
    print("kernel agreement", out, flush=True)
    return out


def _verify_inputs(rows: int, gamma: int, vocab: int, dev: torch.device) -> dict:
    """Random verification inputs: bf16 logits [R, γ+1, V], their fp32 probabilities, draft
    probabilities q [R, γ, V] near them, drafts from q, coins, counter keys."""
    from dspec_cli.core.sampling import logits_to_probs

    g = torch.Generator(device=dev).manual_seed(rows)
    logits = (torch.randn(rows, gamma + 1, vocab, device=dev, generator=g) * 3).bfloat16()
    probs = logits_to_probs(logits.flatten(0, 1), 1.0).view(rows, gamma + 1, vocab)
    noisy = logits[:, :gamma].float() + torch.randn(rows, gamma, vocab, device=dev, generator=g)
    q = logits_to_probs(noisy.flatten(0, 1), 1.0).view(rows, gamma, vocab)
    drafts = torch.multinomial(q.flatten(0, 1), 1, generator=g).view(rows, gamma)
    return dict(logits=logits, probs=probs, q=q, drafts=drafts, ell=torch.full((rows,), gamma, device=dev),
                u=torch.rand(rows, gamma, device=dev, dtype=torch.float64, generator=g).clamp(1e-9, 1 - 1e-9),
                seeds=torch.arange(rows, device=dev) + 7, offsets=torch.zeros(rows, dtype=torch.long, device=dev))


def part_plain(args, progress: Progress) -> dict:
    """The target's decode step through the engine against its bound, and (after B = 1) one
    verify forward of 1, 8, 16, 32 tokens per row against a one-token one."""
    target = build_target(args)
    dev = target.device
    bw = read_bandwidth(dev)
    out: dict = {"context": CONTEXT, "bandwidth": bw, "steps": [], "widths": []}
    cases = [(1, 0.0, "auto"), (1, 1.0, "auto"), "widths", (64, 0.0, "auto"), (64, 1.0, "auto"), (1, 0.0, "eager"),
             (16, 0.0, "auto"), (16, 1.0, "auto"), (64, 0.0, "auto", 1024 if args.small else 4096)]
    for case in cases:
        if isinstance(case, str):
            if progress.left() < 25:
                break
            _widths(target, out, progress)
            continue
        rows, temperature, graphs, *ctx = case
        if progress.left() < (25 if rows > 1 else 10):
            break
        context = ctx[0] if ctx else CONTEXT
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        prompts = random_prompts(rows, context, target.vocab_size, seed=rows)
        run = engine_round_ms(target, None, rows, temperature, graphs, args.new_tokens, prompts)
        bound = bound_ms(target, rows, context + args.new_tokens // 2, bw["read_TBps"] * 1e12)
        out["steps"].append({"B": rows, "temperature": temperature, "graphs": graphs, "context": context, **run,
                             "bound_ms": bound, "x_bound": run["ms_per_round"] / bound, **_memory(dev)})
        print(f"plain B={rows} ctx={context} T={temperature} graphs={graphs}: {run['ms_per_round']:.2f} ms "
              f"({run['ms_per_round'] / bound:.1f}x bound {bound:.2f} ms)", flush=True)
        progress.save(out)
    return out


def _widths(target, out: dict, progress: Progress) -> None:
    rows = out["widths"]
    for q in (1, 8, 16, 32):
        rows.append({"B": 1, "tokens": q, "ms": _score_ms(target, 1, q, CONTEXT)})
        rows[-1]["x_plain"] = rows[-1]["ms"] / rows[0]["ms"]
        print(f"verify width {q}: {rows[-1]['ms']:.2f} ms ({rows[-1]['x_plain']:.2f}x one token)", flush=True)
        progress.save(out)


def part_syncs(args, progress: Progress) -> dict:
    from dspec_cli.checkpoints import load_drafter
    from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine

    target = embedded_target(args)
    prompts = [target.render_prompt(p) for p in ("What is 12 times 7?", "Write a haiku about rain.",
                                                 "def fib(n):", "Name three rivers.")]
    out: dict = {"runs": []}
    for name in ("plain", "dspark-markov", "ddtree"):
        drafter = None if name == "plain" else load_drafter(name, target)
        for temperature in (0.0, 1.0):
            if progress.left() < 8:
                return out
            cfg = GenerationConfig(max_new_tokens=24, temperature=temperature, max_batch=4, seed=0)
            engine = SpeculativeEngine(target, drafter, cfg, stop_ids=())
            engine.generate(prompts)  # warm
            per_round = _count_syncs(engine, prompts, target.device)
            out["runs"].append({"drafter": name, "temperature": temperature, "rounds": len(per_round),
                                "per_round_mean": sum(per_round) / max(len(per_round), 1),
                                "per_round_max": max(per_round, default=0)})
            print(f"syncs {name} T={temperature}: {out['runs'][-1]['per_round_mean']:.2f}/round "
                  f"(max {out['runs'][-1]['per_round_max']})", flush=True)
            progress.save(out)
    return out


def _count_syncs(engine, prompts, device: torch.device) -> list[int]:
    """Synchronisations per round of one generate (CUDA sync-debug mode; host reads on a CPU)."""
    from dspec_cli.runtime.engine import SpeculativeEngine
    from dspec_cli.testing.host_reads import count_host_reads

    per_round: list[int] = []
    warned = [0]
    reads = None

    def total() -> int:
        return reads.total if reads is not None else warned[0]

    real = SpeculativeEngine._round

    def counted(self, rows, results):
        before = total()
        real(self, rows, results)
        per_round.append(total() - before)

    def show(message, *args, **kwargs):
        if "synchroniz" in str(message).lower():
            warned[0] += 1

    SpeculativeEngine._round = counted
    try:
        if device.type == "cuda":
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                old, warnings.showwarning = warnings.showwarning, show
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    engine.generate(prompts)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                    warnings.showwarning = old
        else:
            with count_host_reads() as reads:
                engine.generate(prompts)
    finally:
        SpeculativeEngine._round = real
    return per_round


def part_kernels(args, progress: Progress) -> dict:
    from dspec_cli.core.sampling import CounterNoise
    from dspec_cli.runtime.verify import triton_available

    dev = torch.device(args.device)
    vocab, gamma = (8192 if args.small else 151_936), 7
    backends = ("torch", "triton") if triton_available() and dev.type == "cuda" else ("torch",)
    out: dict = {"runs": []}
    for rows in (1, 64):
        if progress.left() < 10:
            break
        x = _verify_inputs(rows, gamma, vocab, dev)
        noise = CounterNoise(x["seeds"], x["offsets"], 2)
        row = {"R": rows, "gamma": gamma, "vocab": vocab, "read_probs_ms": captured_ms(x["probs"].sum, dev),
               "read_logits_ms": captured_ms(x["logits"].sum, dev),
               "argmax_ms": captured_ms(functools.partial(x["probs"].argmax, -1), dev)}
        for backend in backends:
            for name, fn in _verify_cases(x, noise, backend).items():
                ms = captured_ms(fn, dev)
                read = row["read_logits_ms"] if "logits" in name or "path" in name else row["read_probs_ms"]
                row[f"{backend}_{name}_ms"], row[f"{backend}_{name}_x_read"] = ms, ms / read
        out["runs"].append(row)
        print("kernels", {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        progress.save(out)
    return out


def _verify_cases(x: dict, noise, backend: str) -> dict:
    """The verifications ``part_kernels`` times, as calls on the fixed inputs ``x``: from fp32
    probabilities (token and block rules, one-hot drafts, greedy); from bf16 logits (token and
    block rules), and the path the logits path replaces (fp32 copy, softmax, block rule)."""
    from dspec_cli.core.sampling import logits_to_probs
    from dspec_cli.runtime.verify import (
        verify_chain_grid,
        verify_chain_logits_grid,
        verify_greedy_grid,
    )

    probs, logits, drafts, q, ell = x["probs"], x["logits"], x["drafts"], x["q"], x["ell"]
    kw = dict(uniforms=x["u"], noise=noise, backend=backend)
    return {
        "chain": lambda: verify_chain_grid(probs, drafts, q, ell, **kw),
        "block": lambda: verify_chain_grid(probs, drafts, q, ell, method="block", **kw),
        "one-hot": lambda: verify_chain_grid(probs, drafts, None, ell, **kw),
        "greedy": lambda: verify_greedy_grid(probs, drafts, ell, backend=backend),
        "chain-logits": lambda: verify_chain_logits_grid(logits, drafts, q, ell, temperature=1.0, **kw),
        "block-logits": lambda: verify_chain_logits_grid(logits, drafts, q, ell, temperature=1.0, method="block", **kw),
        "block-probs-path": lambda: verify_chain_grid(logits_to_probs(logits.flatten(0, 1).float(), 1.0).view_as(probs),
                                                      drafts, q, ell, method="block", **kw),
    }


def part_embedded(args, progress: Progress) -> dict:
    from dspec_cli.checkpoints import load_drafter
    from dspec_cli.core.data import load_prompts

    target = embedded_target(args)
    texts = [p.text for p in load_prompts("builtin", None)]
    out: dict = {"runs": []}
    for rows, n_prompts, new_tokens in ((1, 8 if args.small else 12, 64), (64, 64, 32)):
        if args.small and rows > 4:
            rows, n_prompts = 4, 8
        prompts = [target.render_prompt(t) for t in (texts * 4)[:n_prompts]]
        for temperature in (1.0, 0.0):
            if (rows > 1 and temperature == 0.0) or progress.left() < 20:
                continue
            base = engine_round_ms(target, None, rows, temperature, "auto", new_tokens, prompts)
            for name in ("dspark-markov", "ddtree") if rows == 1 else ("dspark-markov",):
                if progress.left() < 10:
                    break
                run = engine_round_ms(target, load_drafter(name, target), rows, temperature, "auto", new_tokens, prompts)
                out["runs"].append({"drafter": name, "R": rows, "temperature": temperature, "tau": run["tau"],
                                    "tokens_per_s": run["tokens_per_s"], "plain_tokens_per_s": base["tokens_per_s"],
                                    "speedup": run["tokens_per_s"] / base["tokens_per_s"],
                                    "ms_per_round": run["ms_per_round"], "plain_ms_per_round": base["ms_per_round"]})
                print(f"embedded {name} R={rows} T={temperature}: {out['runs'][-1]['speedup']:.2f}x "
                      f"(τ {run['tau']:.2f})", flush=True)
                progress.save(out)
    return out


def _score_ms(target, rows: int, q: int, context: int) -> float:
    """One verify forward of q tokens per row as the engine runs it (captured on a GPU)."""
    from dspec_cli.runtime.graphs import GraphRunner, GraphSettings

    graphs = GraphSettings.for_device(target.device)
    runner = GraphRunner(graphs.mode)
    padded = graphs.rows(rows)
    batch = target.new_batch(rows=padded, slots=context + q + graphs.window())
    target.prefill(batch, random_prompts(1, context, target.vocab_size))
    target.select_rows(batch, [0] * rows)
    ids = torch.randint(target.vocab_size, (rows, q), device=target.device)
    window = batch.window(q, graphs.window())
    dense = target.dense(batch, q, window)
    def step(x):  # the engine's verify forward (its outputs unread: the runner copies none)
        target.score(batch, x, None, window, dense, upcast=target.device.type == "cpu")

    return median_ms(lambda: runner("score", step, [ids], padded), target.device)


def part_attention(args, progress: Progress) -> dict:
    """Masked attention at B = 1 (one layer): is the single query's K/V read near the bandwidth
    (no split-KV kernel: a few programs per layer), and the drafter's layout choice."""
    import torch.nn.functional as F

    from dspec_cli.nn.gqa import sdpa_stacked

    dev = torch.device(args.device)
    heads, kv_heads, dim = (4, 2, 32) if args.small else (32, 8, 128)
    dtype = torch.float32 if args.small else torch.bfloat16
    bw = read_bandwidth(dev)
    out: dict = {"bandwidth": bw, "target": [], "drafter": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for context in (512, 4096):
        k, v = (torch.randn(1, kv_heads, context + 64, dim, device=dev, dtype=dtype, generator=g) for _ in range(2))
        query = torch.randn(1, heads, 1, dim, device=dev, dtype=dtype, generator=g)
        mask = torch.arange(context + 64, device=dev)[None, None, None, :] < context  # a window rounded up past the row
        ms = captured_ms(lambda k=k, v=v, query=query, mask=mask: sdpa_stacked(query, k, v, mask), dev)
        kv_ms = 1e3 * 2 * k.numel() * k.element_size() / (bw["read_TBps"] * 1e12)
        out["target"].append({"context": context, "ms": ms, "kv_read_ms": kv_ms, "x_read": ms / kv_ms})
        print("attention target", out["target"][-1], flush=True)
        progress.save(out)
    for rows in (1, 64):  # the drafter: a block of 8 queries over context + block under a bool mask
        k, v = (torch.randn(rows, kv_heads, CONTEXT + 8, dim, device=dev, dtype=dtype, generator=g) for _ in range(2))
        query = torch.randn(rows, 8, heads, dim, device=dev, dtype=dtype, generator=g).transpose(1, 2)
        mask = torch.ones(rows, 1, 1, CONTEXT + 8, dtype=torch.bool, device=dev)
        gqa = captured_ms(lambda q=query, k=k, v=v, m=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                                                            enable_gqa=True), dev)
        stacked = captured_ms(lambda q=query, k=k, v=v, m=mask: sdpa_stacked(q, k, v, m), dev)
        out["drafter"].append({"R": rows, "enable_gqa_ms": gqa, "stacked_ms": stacked})
        print("attention drafter", out["drafter"][-1], flush=True)
        progress.save(out)
    return out


def part_profile(args, progress: Progress) -> dict:
    from dspec_cli.workflows.target_profile import profile_target

    target = build_target(args)
    bw = read_bandwidth(target.device)
    tokens = [1, 8, 64, 512, 1024]
    table = profile_target(target, grid=tokens, contexts=[CONTEXT], repeats=8, warmup=2, model_name="random qwen3-4b")
    ms = [1e3 / s for s in table.measured[str(CONTEXT)]]
    bounds = [bound_ms(target, -(-b // 8), CONTEXT, bw["read_TBps"] * 1e12) for b in tokens]
    for b, m, lo in zip(tokens, ms, bounds, strict=True):
        print(f"profile B={b}: {m:.2f} ms (bound {lo:.2f})", flush=True)
    return {"context": CONTEXT, "tokens": tokens, "ms": ms, "bound_ms": bounds,
            "x_bound": [m / lo for m, lo in zip(ms, bounds, strict=True)]}


def part_bandwidth(args, progress: Progress) -> dict:
    return read_bandwidth(torch.device(args.device))


# -- goals and the driver -------------------------------------------------------------------------

def goals(report: dict) -> dict:
    """Each goal figure against its target (None where its part did not run)."""
    out: dict = {}

    def goal(name, value, target, ok):
        out[name] = {"value": value, "target": target, "met": None if value is None else bool(ok(value))}

    runs = report.get("correct", {}).get("runs", [])
    goal("captured rounds give the uncaptured tokens", all(r["same_tokens"] for r in runs) if runs else None, "all",
         bool)
    steps = {(s["B"], s["temperature"], s["graphs"], s.get("context", CONTEXT)): s
             for s in report.get("plain", {}).get("steps", [])}
    for rows in (1, 64):
        s = steps.get((rows, 0.0, "auto", CONTEXT))
        goal(f"plain step B={rows} within 2x bound", s and s["x_bound"], "<= 2", lambda v: v <= 2)
    t0, t1 = steps.get((1, 0.0, "auto", CONTEXT)), steps.get((1, 1.0, "auto", CONTEXT))
    goal("plain step T=1 vs T=0 (B=1)", t0 and t1 and t1["ms_per_round"] / t0["ms_per_round"], "<= 1.05",
         lambda v: v <= 1.05)
    widths = {w["tokens"]: w for w in report.get("plain", {}).get("widths", [])}
    goal("verify 8 tokens vs plain step (B=1)", widths.get(8, {}).get("x_plain"), "<= 1.15", lambda v: v <= 1.15)
    syncs = report.get("syncs", {}).get("runs", [])
    goal("host syncs per round (max over runs)", max((r["per_round_max"] for r in syncs), default=None), "<= 1",
         lambda v: v <= 1)
    emb = {(r["drafter"], r["R"], r["temperature"]): r for r in report.get("embedded", {}).get("runs", [])}
    goal("embedded dspark R=1 T=1 speedup", (emb.get(("dspark-markov", 1, 1.0)) or {}).get("speedup"), ">= 1.8",
         lambda v: v >= 1.8)
    goal("embedded dspark R=64 T=1 speedup", (emb.get(("dspark-markov", 64, 1.0)) or {}).get("speedup"), ">= 1.3",
         lambda v: v >= 1.3)
    tree, chain = emb.get(("ddtree", 1, 1.0)), emb.get(("dspark-markov", 1, 1.0))
    goal("ddtree vs dspark chain (R=1, T=1)", tree and chain and tree["speedup"] / chain["speedup"], "> 1",
         lambda v: v > 1)
    prof = report.get("profile", {})
    goal("profile B=1 within 2x bound", (prof.get("x_bound") or [None])[0], "<= 2", lambda v: v <= 2)
    for run in report.get("kernels", {}).get("runs", []):
        for kind in ("chain", "block", "one-hot", "greedy", "chain-logits", "block-logits"):
            value = run.get(f"triton_{kind}_x_read", run.get(f"torch_{kind}_x_read"))
            goal(f"verify {kind} R={run['R']} vs reading its input", value, "<= 2", lambda v: v <= 2)
    return out


def machine(device: str) -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device,
            "python": sys.version.split()[0]}
    if device.startswith("cuda") and torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run (parts that no longer fit are skipped)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="a two-layer toy target (CPU dry run)")
    p.add_argument("--parts", default=",".join(part.name for part in PARTS))
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per request in the plain-step runs")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # one part in this process (the driver's child)
    p.add_argument("--until", type=float, default=None, help=argparse.SUPPRESS)  # the child's deadline (epoch seconds)
    args = p.parse_args(argv)
    if args.part is not None:
        progress = Progress(args.json, args.until)
        progress.save(globals()[f"part_{args.part}"](args, progress))
        return
    names = args.parts.split(",")
    unknown = [n for n in names if n not in {part.name for part in PARTS}]
    if unknown:
        raise SystemExit(f"--parts: unknown part {unknown[0]!r} (parts: {', '.join(part.name for part in PARTS)})")
    info = {"machine": machine(args.device), "small": args.small}

    def run(part: Part, seconds: float) -> Outcome:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "part.json"
            cmd = [sys.executable, "-m", "benchmarks.gpu", "--part", part.name, "--json", str(out), "--device",
                   args.device, "--new-tokens", str(args.new_tokens), "--until", str(time.time() + seconds - GRACE)]
            outcome = launch(cmd + (["--small"] if args.small else []), out, seconds)
        print(f"[{part.name}] {'ERROR ' + outcome.error if outcome.error else 'done'}", flush=True)
        return outcome

    def update(report: dict) -> None:
        write_json(args.json, {**info, **report, "goals": goals(report)})  # after every part: a later stop loses nothing

    report = run_parts([part for part in PARTS if part.name in names], args.budget, run, update)
    for name, g in goals(report).items():
        print(f"{'met ' if g['met'] else 'MISS' if g['met'] is False else '  - '} {name}: {g['value']} ({g['target']})")


if __name__ == "__main__":
    main()

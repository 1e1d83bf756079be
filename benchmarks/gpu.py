"""GPU benchmark (not a test): every figure of dspec's GPU goals, in one JSON.

    python -m benchmarks.gpu --json OUT.json [--device cuda] [--small] [--parts a,b,...]

Builds a random-init Qwen3-4B-shaped target in memory (bf16, vocabulary 151,936; no download;
``--small`` a two-layer toy for a CPU dry run) and measures, each part in its own process with
its own timeout (a part that fails or hangs leaves an entry in ``errors`` and the rest stands):

* ``bandwidth``: the device's measured read and copy bandwidth;
* ``plain``: a plain decode step through dspec's engine at B = 1, 16, 64 and T = 0, 1 (context
  512), against the bound = (weight bytes + KV bytes read per step) / read bandwidth, with and
  without CUDA graphs;
* ``widths``: one verify forward of 1, 8, 16, 32 tokens per row at B = 1 (the engine's captured
  step) against a plain step;
* ``profile``: ``profile-hardware``'s curve (the engine's captured forward) at 1, 8, 64, 512,
  1,024 batch tokens, context 512, with its bound;
* ``syncs``: host synchronisations per round of the engine (CUDA sync-debug mode; on a CPU the
  host reads :func:`dspec_cli.testing.host_reads.count_host_reads` counts), plain, dspark and
  ddtree at T = 0 and 1, on the embedded target;
* ``kernels``: verification at R = 1 and 64, γ = 7, V = 151,936 (token and block rules with draft
  probabilities, one-hot drafts, greedy) on the padded-grid path the engine runs, on the torch
  reference and on the Triton kernels (what a CUDA round uses), against the time to read the
  logits once and torch's argmax;
* ``embedded``: the embedded target, dspark and ddtree against plain decoding at R = 1 and 64.

``goals`` sums up each figure against its target (met / missed). Times are medians of timed
repetitions after warm-up, CUDA synchronised. About 3 to 5 minutes on an H200.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

CONTEXT = 512
PARTS = ("bandwidth", "plain", "widths", "profile", "syncs", "kernels", "embedded")
TIMEOUTS = {"bandwidth": 60, "plain": 150, "widths": 90, "profile": 120, "syncs": 150, "kernels": 90, "embedded": 180}
SMALL = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             vocab_size=8192, max_position_embeddings=4096, num_hidden_layers=2, tie_word_embeddings=True)


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


def bound_ms(target, rows: int, context: int, read_bps: float) -> float:
    """Bytes a decode step must read (every weight once, each row's KV cache) over ``read_bps``."""
    cfg = target.config
    weights = sum(p.numel() * p.element_size() for p in target.model.parameters())
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * target.dtype.itemsize * context * rows
    return 1e3 * (weights + kv) / read_bps


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
            "tokens_per_s": tokens / wall, "tau": tokens / max(st.rounds * rows, 1) if drafter else 1.0}


# -- parts ----------------------------------------------------------------------------------------

def part_bandwidth(args) -> dict:
    return read_bandwidth(torch.device(args.device))


def part_plain(args) -> dict:
    target = build_target(args)
    bw = read_bandwidth(target.device)
    out = []
    for rows in (1, 16, 64):
        prompts = random_prompts(rows, CONTEXT, target.vocab_size, seed=rows)
        for temperature in (0.0, 1.0):
            for graphs in (("auto", "eager") if rows == 1 else ("auto",)):
                run = engine_round_ms(target, None, rows, temperature, graphs, args.new_tokens, prompts)
                bound = bound_ms(target, rows, CONTEXT + args.new_tokens // 2, bw["read_TBps"] * 1e12)
                out.append({"B": rows, "temperature": temperature, "graphs": graphs, **run, "bound_ms": bound,
                            "x_bound": run["ms_per_round"] / bound})
                print(f"plain B={rows} T={temperature} graphs={graphs}: {run['ms_per_round']:.2f} ms "
                      f"({run['ms_per_round'] / bound:.1f}x bound {bound:.2f} ms)", flush=True)
    return {"context": CONTEXT, "bandwidth": bw, "steps": out}


def _score_ms(target, rows: int, q: int, context: int, cuda_graphs: bool = True) -> float:
    """One verify forward of q tokens per row as the engine runs it (captured on a GPU)."""
    from dspec_cli.runtime.graphs import GraphRunner, GraphSettings

    graphs = GraphSettings.for_device(target.device, cuda_graphs)
    runner = GraphRunner(graphs.mode)
    padded = graphs.rows(rows)
    batch = target.new_batch(rows=padded, slots=context + q + graphs.window())
    target.prefill(batch, random_prompts(1, context, target.vocab_size))
    target.select_rows(batch, [0] * rows)
    ids = torch.randint(target.vocab_size, (rows, q), device=target.device)
    window = batch.window(q, graphs.window())
    dense = target.dense(batch, q, window)
    return median_ms(lambda: runner("score", lambda x: target.score(batch, x, None, window, dense), [ids], padded),
                     target.device)


def part_widths(args) -> dict:
    target = build_target(args)
    out = [{"B": 1, "tokens": q, "ms": _score_ms(target, 1, q, CONTEXT)} for q in (1, 8, 16, 32)]
    for row in out:
        row["x_plain"] = row["ms"] / out[0]["ms"]
        print(f"verify width {row['tokens']}: {row['ms']:.2f} ms ({row['x_plain']:.2f}x one token)", flush=True)
    return {"context": CONTEXT, "widths": out}


def part_profile(args) -> dict:
    from dspec_cli.workflows.target_profile import profile_target

    target = build_target(args)
    bw = read_bandwidth(target.device)
    tokens = [1, 8, 64, 512, 1024]
    table = profile_target(target, grid=tokens, contexts=[CONTEXT], repeats=8, warmup=2, model_name="random qwen3-4b")
    ms = [1e3 / s for s in table.measured[str(CONTEXT)]]
    bounds = [bound_ms(target, -(-b // 8), CONTEXT, bw["read_TBps"] * 1e12) for b in tokens]
    for b, m, lo in zip(tokens, ms, bounds, strict=True):
        print(f"profile B={b}: {m:.2f} ms (bound {lo:.2f})", flush=True)
    return {"context": CONTEXT, "tokens": tokens, "ms": ms, "bound_ms": bounds, "x_bound": [m / lo for m, lo in
                                                                                            zip(ms, bounds, strict=True)]}


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


def part_syncs(args) -> dict:
    from dspec_cli.checkpoints import load_drafter
    from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
    from dspec_cli.runtime.target import Target

    target = Target.load(None, device=args.device, dtype="bfloat16" if args.device != "cpu" else "float32")
    prompts = [target.render_prompt(p) for p in ("What is 12 times 7?", "Write a haiku about rain.",
                                                 "def fib(n):", "Name three rivers.")]
    out = []
    for name in ("plain", "dspark-markov", "ddtree"):
        drafter = None if name == "plain" else load_drafter(name, target)
        for temperature in (0.0, 1.0):
            cfg = GenerationConfig(max_new_tokens=24, temperature=temperature, max_batch=4, seed=0)
            engine = SpeculativeEngine(target, drafter, cfg, stop_ids=())
            engine.generate(prompts)  # warm
            per_round = _count_syncs(engine, prompts, target.device)
            out.append({"drafter": name, "temperature": temperature, "rounds": len(per_round),
                        "per_round_mean": sum(per_round) / max(len(per_round), 1),
                        "per_round_max": max(per_round, default=0)})
            print(f"syncs {name} T={temperature}: {out[-1]['per_round_mean']:.2f}/round "
                  f"(max {out[-1]['per_round_max']})", flush=True)
    return {"runs": out}


def part_kernels(args) -> dict:
    from dspec_cli.core.sampling import logits_to_probs
    from dspec_cli.runtime.graphs import GraphRunner
    from dspec_cli.runtime.verify import (
        triton_available,
        verify_chain_grid,
        verify_greedy_grid,
    )

    dev = torch.device(args.device)
    vocab, gamma = (8192 if args.small else 151_936), 7
    mode = "cuda" if dev.type == "cuda" else "eager"
    backends = ("torch", "triton") if triton_available() and dev.type == "cuda" else ("torch",)
    out = []
    for rows in (1, 64):
        g = torch.Generator(device=dev).manual_seed(rows)
        logits = torch.randn(rows, gamma + 1, vocab, device=dev, generator=g) * 3
        probs = logits_to_probs(logits.flatten(0, 1), 1.0).view(rows, gamma + 1, vocab)
        q = logits_to_probs(torch.randn(rows * gamma, vocab, device=dev, generator=g) * 3, 1.0).view(rows, gamma, vocab)
        drafts = q.flatten(0, 1).argmax(-1).view(rows, gamma)
        ell = torch.full((rows,), gamma, device=dev)
        u = torch.rand(rows, gamma, device=dev, dtype=torch.float64, generator=g).clamp(1e-9, 1 - 1e-9)
        noise = -torch.rand(rows, vocab, device=dev, generator=g).clamp_min(1e-9).log()
        read_ms = median_ms(lambda probs=probs: probs.sum(), dev)
        runner = GraphRunner(mode)
        cases = {
            "chain": lambda p, x, qq, backend, ell=ell, u=u, noise=noise: verify_chain_grid(
                p, x, qq, ell, uniforms=u, noise=noise, backend=backend).tokens,
            "block": lambda p, x, qq, backend, ell=ell, u=u, noise=noise: verify_chain_grid(
                p, x, qq, ell, method="block", uniforms=u, noise=noise, backend=backend).tokens,
            "one-hot": lambda p, x, qq, backend, ell=ell, u=u, noise=noise: verify_chain_grid(
                p, x, None, ell, uniforms=u, noise=noise, backend=backend).tokens,
            "greedy": lambda p, x, qq, backend, ell=ell: verify_greedy_grid(p, x, ell, backend=backend).tokens,
        }
        row = {"R": rows, "gamma": gamma, "vocab": vocab, "read_logits_ms": read_ms,
               "argmax_ms": median_ms(lambda probs=probs: probs.argmax(-1), dev)}
        for backend in backends:
            for name, fn in cases.items():
                step = functools.partial(fn, backend=backend)
                ms = median_ms(lambda step=step, key=(name, rows, backend), runner=runner, probs=probs, drafts=drafts,
                               q=q, rows=rows: runner(key, step, [probs, drafts, q], rows), dev)
                row[f"{backend}_{name}_ms"], row[f"{backend}_{name}_x_read"] = ms, ms / read_ms
        out.append(row)
        print("kernels", {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return {"runs": out}


def part_embedded(args) -> dict:
    from dspec_cli.checkpoints import load_drafter
    from dspec_cli.core.data import load_prompts
    from dspec_cli.runtime.target import Target

    target = Target.load(None, device=args.device, dtype="bfloat16" if args.device != "cpu" else "float32")
    texts = [p.text for p in load_prompts("builtin", None)]
    out = []
    for rows, n_prompts, new_tokens in ((1, 8 if args.small else 12, 64), (64, 64, 32)):
        if args.small and rows > 4:
            rows, n_prompts = 4, 8
        prompts = [target.render_prompt(t) for t in (texts * 4)[:n_prompts]]
        for temperature in (1.0, 0.0):
            if rows > 1 and temperature == 0.0:
                continue
            base = engine_round_ms(target, None, rows, temperature, "auto", new_tokens, prompts)
            for name in ("dspark-markov", "ddtree") if rows == 1 else ("dspark-markov",):
                drafter = load_drafter(name, target)
                run = engine_round_ms(target, drafter, rows, temperature, "auto", new_tokens, prompts)
                out.append({"drafter": name, "R": rows, "temperature": temperature, "tau": run["tau"],
                            "tokens_per_s": run["tokens_per_s"], "plain_tokens_per_s": base["tokens_per_s"],
                            "speedup": run["tokens_per_s"] / base["tokens_per_s"],
                            "ms_per_round": run["ms_per_round"], "plain_ms_per_round": base["ms_per_round"]})
                print(f"embedded {name} R={rows} T={temperature}: {out[-1]['speedup']:.2f}x (τ {run['tau']:.2f})",
                      flush=True)
    return {"runs": out}


# -- goals and the driver -------------------------------------------------------------------------

def goals(report: dict) -> dict:
    """Each goal figure against its target (None where its part did not run)."""
    out: dict = {}

    def goal(name, value, target, ok):
        out[name] = {"value": value, "target": target, "met": None if value is None else bool(ok(value))}

    steps = {(s["B"], s["temperature"], s["graphs"]): s for s in report.get("plain", {}).get("steps", [])}
    for rows in (1, 64):
        s = steps.get((rows, 0.0, "auto"))
        goal(f"plain step B={rows} within 2x bound", s and s["x_bound"], "<= 2", lambda v: v <= 2)
    t0, t1 = steps.get((1, 0.0, "auto")), steps.get((1, 1.0, "auto"))
    goal("plain step T=1 vs T=0 (B=1)", t0 and t1 and t1["ms_per_round"] / t0["ms_per_round"], "<= 1.05",
         lambda v: v <= 1.05)
    widths = {w["tokens"]: w for w in report.get("widths", {}).get("widths", [])}
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
        for kind in ("chain", "block", "one-hot", "greedy"):
            for backend in ("torch", "triton"):
                value = run.get(f"{backend}_{kind}_x_read")
                if value is not None:
                    goal(f"verify {kind} {backend} R={run['R']} vs reading the logits", value, "<= 2",
                         lambda v: v <= 2)
        goal(f"greedy torch R={run['R']} vs argmax", run["torch_greedy_ms"] / run["argmax_ms"], "<= 1",
             lambda v: v <= 1)
    return out


def machine(device: str) -> dict:
    info = {"torch": torch.__version__, "device": device, "python": sys.version.split()[0]}
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
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="a two-layer toy target (CPU dry run)")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per request in the plain-step runs")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # one part in this process (the driver's child)
    args = p.parse_args(argv)
    if args.part is not None:
        result = globals()[f"part_{args.part}"](args)
        args.json.write_text(json.dumps(result, indent=1))
        return
    report: dict = {"machine": machine(args.device), "small": args.small, "errors": {}, "seconds": {}}
    for part in args.parts.split(","):
        if part not in PARTS:
            raise SystemExit(f"--parts: unknown part {part!r} (parts: {', '.join(PARTS)})")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "part.json"
            cmd = [sys.executable, "-m", "benchmarks.gpu", "--part", part, "--json", str(out), "--device", args.device,
                   "--new-tokens", str(args.new_tokens)] + (["--small"] if args.small else [])
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, timeout=TIMEOUTS[part], capture_output=True, text=True)
                if proc.returncode == 0 and out.exists():
                    report[part] = json.loads(out.read_text())
                else:
                    report["errors"][part] = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            except subprocess.TimeoutExpired:
                report["errors"][part] = f"timed out after {TIMEOUTS[part]} s"
            report["seconds"][part] = time.perf_counter() - t0
            print(f"[{part}] {report['seconds'][part]:.0f} s{' ERROR' if part in report['errors'] else ''}", flush=True)
        report["goals"] = goals(report)
        args.json.write_text(json.dumps(report, indent=1))  # after every part: a timeout later loses nothing
    for name, g in report["goals"].items():
        print(f"{'met ' if g['met'] else 'MISS' if g['met'] is False else '  - '} {name}: {g['value']} ({g['target']})")


if __name__ == "__main__":
    main()

"""Verifier micro-benchmark (not a test).

    python -m benchmarks.verify [--json PATH] [--backends torch,triton] [--quick | --dry-run]
    python -m benchmarks.verify --kernels [--json PATH] [--dtype bfloat16] [--dry-run]

Times verify_chain (token verification with draft probabilities and one-hot, block verification)
and verify_greedy for every backend over R x γ x V, with every request drafting γ tokens, explicit randomness and validate=False
(the hot path; --validate adds the checks). Reports the median of the repeats after warm-up,
synchronising CUDA around each call. Triton runs only on CUDA.

``--kernels`` times each Triton call alone (sizes passed in, no checks, counter noise) at R = 1
and 64, γ = 7, V = 151,936 against the time to read the logits it is given once (``torch.sum``
over them): chain, chain with one-hot drafts, chain from logits at T = 1, greedy, and the
target's draw at T = 0 and T = 1, beside the torch reference (and torch's argmax). On CUDA each
call is also captured in a CUDA graph and replayed (which fails if the call reads anything back
to the host); the ratio uses the replay. ``--dry-run`` runs the same code on tiny sizes (with
``--kernels`` on a CPU: under ``TRITON_INTERPRET=1``, set before Python starts).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from dspec_cli.core.hardware import device_name
from dspec_cli.core.sampling import (
    CounterNoise,
    logits_to_probs,
    sample_from_probs,
    torch_exponential,
    torch_uniform,
)
from dspec_cli.runtime.verify import (
    reference,
    triton_available,
    verify_chain,
    verify_greedy,
)

FULL_GRID = dict(R=(1, 16, 64, 256), gamma=(4, 7, 16), V=(32000, 151936))
QUICK_GRID = dict(R=(1, 16, 64), gamma=(4,), V=(32000,))
KINDS = ("chain", "chain-block", "chain-onehot", "greedy")


def _inputs(R: int, gamma: int, V: int, device, generator: torch.Generator) -> dict:
    """Target/draft distributions close enough that roughly half the drafts are accepted."""
    rows = R * (gamma + 1)
    logits = torch.randn(rows, V, generator=generator).mul_(3).to(device)
    bonus = torch.zeros(rows, dtype=torch.bool, device=device)
    bonus[gamma :: gamma + 1] = True
    draft_probs = torch.softmax(logits[~bonus] + torch.randn(R * gamma, V, generator=generator).to(device), -1)
    noise = torch_exponential((R * gamma, V), generator=generator).to(device)
    return dict(
        logits=logits,
        target_probs=torch.softmax(logits, -1),
        draft_probs=draft_probs,
        draft_tokens=(draft_probs / noise).argmax(-1),
        num_draft=torch.full((R,), gamma, dtype=torch.long, device=device),
        uniforms=torch_uniform((R * gamma,), generator=generator).to(device),
        noise=torch_exponential((R, V), generator=generator).to(device),
    )


def _call(kind: str, x: dict, backend: str, validate: bool):
    if kind == "greedy":
        return verify_greedy(x["logits"], x["draft_tokens"], x["num_draft"], backend=backend, validate=validate)
    q = None if kind == "chain-onehot" else x["draft_probs"]
    return verify_chain(
        x["target_probs"], x["draft_tokens"], q, x["num_draft"], method="block" if kind == "chain-block" else "token",
        uniforms=x["uniforms"], noise=x["noise"], backend=backend, validate=validate,
    )  # fmt: skip


def _time(fn, device, warmup: int, repeats: int) -> list[float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _gib(R: int, gamma: int, V: int) -> float:
    """Approximate input memory: logits, target probs, draft probs (+ noise), float32."""
    return (3 * R * (gamma + 1) + 2 * R * gamma + R) * V * 4 / 2**30


def _env(device: torch.device) -> dict:
    name = device_name(device)
    triton_version = None
    if triton_available():
        import triton

        triton_version = triton.__version__
    return dict(
        torch=torch.__version__,
        triton=triton_version,
        device=str(device),
        device_name=name,
        threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(),
        python=platform.python_version(),
    )


def run(backends, grid: dict, device: torch.device, warmup: int, repeats: int, validate: bool, max_gib: float) -> dict:
    results, skipped = [], []
    gen = torch.Generator().manual_seed(0)
    for V in grid["V"]:
        for gamma in grid["gamma"]:
            for R in grid["R"]:
                if _gib(R, gamma, V) > max_gib:
                    skipped.append(dict(R=R, gamma=gamma, V=V, reason=f"inputs > {max_gib} GiB"))
                    continue
                x = _inputs(R, gamma, V, device, gen)
                for backend in backends:
                    for kind in KINDS:
                        times = _time(lambda kind=kind, x=x, backend=backend: _call(kind, x, backend, validate),
                                      device, warmup, repeats)
                        tau = _call(kind, x, backend, False).num_tokens.float().mean().item()
                        results.append(
                            dict(backend=backend, kind=kind, R=R, gamma=gamma, V=V,
                                 median_ms=statistics.median(times), min_ms=min(times), tau=tau)
                        )  # fmt: skip
                del x
    return dict(
        env=_env(device),
        config=dict(grid=grid, warmup=warmup, repeats=repeats, validate=validate, backends=list(backends)),
        results=results,
        skipped=skipped,
    )


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    env = report["env"]
    title = f"verify benchmark: {env['device_name']} ({env['device']}), torch {env['torch']}, {env['threads']} threads"
    table = Table(title=title)
    for col in ("backend", "kind", "R", "γ", "V", "median ms", "min ms", "µs / request", "τ"):
        table.add_column(col, justify="left" if col in ("backend", "kind") else "right")
    for r in report["results"]:
        table.add_row(
            r["backend"], r["kind"], str(r["R"]), str(r["gamma"]), str(r["V"]),
            f"{r['median_ms']:.3f}", f"{r['min_ms']:.3f}", f"{1e3 * r['median_ms'] / r['R']:.1f}", f"{r['tau']:.2f}",
        )  # fmt: skip
    console = Console()
    console.print(table)
    for s in report["skipped"]:
        console.print(f"skipped R={s['R']} γ={s['gamma']} V={s['V']}: {s['reason']}")


# -- --kernels: each Triton call against one read of its logits ----------------------------

KERNEL_GRID = dict(R=(1, 64), gamma=(7,), V=(151936,))
DRY_GRID = dict(R=(1, 4), gamma=(3,), V=(1000,))


def _device_us(fn, device: torch.device, repeats: int) -> dict:
    """Per-call µs of fn: back-to-back calls between CUDA events (CPU: wall clock), and on CUDA
    the replay of one call captured in a CUDA graph (no host work; capture fails on a host read)."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return dict(eager_us=1e6 * (time.perf_counter() - start) / repeats, graph_us=None)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    torch.cuda.synchronize()
    events[0].record()
    for _ in range(repeats):
        fn()
    events[1].record()
    torch.cuda.synchronize()
    out: dict = dict(eager_us=1e3 * events[0].elapsed_time(events[1]) / repeats, graph_us=None)
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm the caching allocator on the capture stream
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        events[0].record()
        for _ in range(repeats):
            graph.replay()
        events[1].record()
        torch.cuda.synchronize()
        out["graph_us"] = 1e3 * events[0].elapsed_time(events[1]) / repeats
    except RuntimeError as err:  # e.g. a host synchronisation inside the call
        out["graph_error"] = str(err).split("\n")[0]
    return out


def _kernel_cases(R: int, gamma: int, V: int, dtype: torch.dtype, device, generator) -> list[dict]:
    """(kind, Triton call, torch call, the tensor whose one read is the bound) at one size."""
    from dspec_cli.runtime.verify import (
        triton as impl,  # needs triton; only with --kernels
    )

    x = _inputs(R, gamma, V, device, generator)
    logits, probs = x["logits"].to(dtype), x["target_probs"].to(dtype)
    num, drafts, q, u = x["num_draft"], x["draft_tokens"], x["draft_probs"], x["uniforms"].double()
    total, width = R * gamma, gamma
    seeds = torch.arange(R, device=device) + 1
    noise = CounterNoise(seeds, seeds * 4096, 2)
    first = logits[gamma :: gamma + 1]  # [R, V] the bonus rows: the logits a plain step draws from
    one_hot = drafts  # drafts sampled from q; verified as one-hot drafts
    return [
        dict(kind="chain", read=probs,
             triton=lambda: impl.chain(probs, drafts, q, num, u, noise, total, width),
             torch=lambda: reference.chain(probs, drafts, q, num, u, noise, total, width)),
        dict(kind="chain-onehot", read=probs,
             triton=lambda: impl.chain(probs, one_hot, None, num, u, noise, total, width),
             torch=lambda: reference.chain(probs, one_hot, None, num, u, noise, total, width)),
        dict(kind="chain-logits T=1", read=logits,
             triton=lambda: impl.chain_logits(logits, 1.0, drafts, q, num, u, noise, total, width),
             torch=lambda: reference.chain(logits_to_probs(logits, 1.0), drafts, q, num, u, noise, total, width)),
        dict(kind="greedy", read=logits,
             triton=lambda: impl.greedy(logits, drafts, num, total, width),
             torch=lambda: reference.greedy(logits, drafts, num, total, width),
             argmax=lambda: logits.argmax(-1)),
        dict(kind="draw T=0", read=first,
             triton=lambda: impl.draw(first, 0.0, None),
             torch=lambda: first.argmax(-1)),
        dict(kind="draw T=1", read=first,
             triton=lambda: impl.draw(first, 1.0, noise),
             torch=lambda: sample_from_probs(logits_to_probs(first, 1.0), noise.tensor(V))),
    ]  # fmt: skip


def run_kernels(grid: dict, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    results = []
    gen = torch.Generator().manual_seed(0)
    for V in grid["V"]:
        for gamma in grid["gamma"]:
            for R in grid["R"]:
                for case in _kernel_cases(R, gamma, V, dtype, device, gen):
                    read = case["read"]
                    bound = _device_us(lambda read=read: read.sum(), device, repeats)
                    read_us = bound["graph_us"] or bound["eager_us"]
                    row: dict = dict(kind=case["kind"], R=R, gamma=gamma, V=V, dtype=str(dtype).replace("torch.", ""),
                                     read_shape=list(read.shape), read_us=read_us)  # fmt: skip
                    for name in ("triton", "torch", "argmax"):
                        if name in case:
                            timing = _device_us(case[name], device, repeats)
                            row.update({f"{name}_{k}": v for k, v in timing.items()})
                            if name == "triton":
                                row["triton_over_read"] = (timing["graph_us"] or timing["eager_us"]) / read_us
                    results.append(row)
    return dict(env=_env(device), config=dict(grid=grid, dtype=str(dtype), repeats=repeats), kernels=results)


def _print_kernels(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    env = report["env"]
    table = Table(title=f"Triton verify kernels vs one read of their logits: {env['device_name']} ({env['device']})")
    for col in ("kind", "R", "γ", "V", "read µs", "Triton µs", "graph µs", "÷ read", "torch µs", "argmax µs"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in report["kernels"]:
        table.add_row(r["kind"], str(r["R"]), str(r["gamma"]), str(r["V"]), f(r["read_us"]), f(r["triton_eager_us"]),
                      f(r.get("triton_graph_us")), f"{r['triton_over_read']:.2f}", f(r["torch_eager_us"]),
                      f(r.get("argmax_eager_us")))  # fmt: skip
    Console().print(table)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.verify", description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the report as JSON here")
    parser.add_argument("--backends", default=None, help="comma-separated: torch,triton (default: all that run here)")
    parser.add_argument("--quick", action="store_true", help="a small subset of the grid")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--validate", action="store_true", help="time with input validation on")
    parser.add_argument("--max-gib", type=float, default=None, help="skip shapes whose inputs exceed this")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--kernels", action="store_true", help="each Triton call against one read of its logits")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="--kernels: logits dtype")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes (with --kernels on a CPU: TRITON_INTERPRET=1 set before Python starts)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    if args.kernels:
        if not triton_available():
            parser.error("--kernels: needs the triton package")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--kernels: needs CUDA, or TRITON_INTERPRET=1 set before Python starts (with --dry-run)")
        grid = DRY_GRID if args.dry_run else KERNEL_GRID
        report = run_kernels(grid, device, getattr(torch, args.dtype), args.repeats or (2 if args.dry_run else 200))
        _print_kernels(report)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2))
        return
    on_cuda = device.type == "cuda"
    available = ["torch"] + (["triton"] if on_cuda and triton_available() else [])
    backends = args.backends.split(",") if args.backends else available
    for b in backends:
        if b not in ("torch", "triton"):
            parser.error(f"--backends: unknown backend {b!r}")
        if b not in available:
            parser.error(f"--backends: {b!r} does not run on {device} here (Triton needs CUDA and the triton package)")
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 10)
    max_gib = args.max_gib if args.max_gib is not None else (40.0 if on_cuda else 6.0)
    grid = DRY_GRID if args.dry_run else QUICK_GRID if args.quick else FULL_GRID
    report = run(backends, grid, device, warmup, repeats, args.validate, max_gib)
    _print(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

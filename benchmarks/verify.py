"""Verifier micro-benchmark (not a test).

    python -m benchmarks.verify [--json PATH] [--backends torch,triton] [--quick]

Times verify_chain (token verification with draft probabilities and one-hot, block verification)
and verify_greedy for every backend over R x γ x V, with every request drafting γ tokens, explicit randomness and validate=False
(the hot path; --validate adds the checks). Reports the median of the repeats after warm-up,
synchronising CUDA around each call. Triton runs only on CUDA.
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
from dspec_cli.core.sampling import torch_exponential, torch_uniform
from dspec_cli.runtime.verify import triton_available, verify_chain, verify_greedy

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
                        times = _time(lambda: _call(kind, x, backend, validate), device, warmup, repeats)
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
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
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
    report = run(backends, QUICK_GRID if args.quick else FULL_GRID, device, warmup, repeats, args.validate, max_gib)
    _print(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

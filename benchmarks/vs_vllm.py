"""dspec's engine against vLLM's CPU build on the same prompts, the same target and the same CPU.

    python -m benchmarks.vs_vllm --dataset gsm8k.jsonl --dataset humaneval.jsonl --dataset mt-bench.jsonl \
        --num-prompts 4 [--skip 0] --max-new-tokens 128 --concurrency 1,8 --temperature 0,1 \
        --drafter dspark --drafter dflash --vllm-export dflash --vllm-spec ngram \
        --repeats 3 --profile --json docs/results/vs-vllm.json

Both engines serve the embedded target in bfloat16 and get the same token ids (the prompts rendered
once by dspec's chat template, ``--skip`` picks a slice of each set). Every request generates exactly
``--max-new-tokens`` tokens (no stop tokens in either engine). At R = 1 requests run one at a time; at
R > 1 all prompts are queued and served R at a time (continuous batching in both). vLLM runs in its
own environment (``--vllm-python``, its CPU build with libiomp5 preloaded as its documentation
asks, ``enforce_eager``) as one subprocess per configuration (:mod:`benchmarks.vllm_worker`); dspec
runs in this process. ``--vllm-export NAME`` serves dspec's drafter NAME in vLLM (written by
``dspec export --format vllm`` into a temporary folder); ``--vllm-spec ngram`` is vLLM's n-gram
drafter with :data:`VLLM_SPECS`' settings, ``--vllm-spec NAME=JSON`` any other speculative_config. Repeats are interleaved: each repeat runs every engine once per (T, R) cell,
in a rotating order, so machine drift hits every engine alike; the table gives the median tokens/s
and the range over repeats, each engine's ratio to vLLM plain decoding of the same repeat (median and
range), and at T = 0 how many outputs equal dspec's plain greedy output token for token.
``--profile`` adds where one request's time goes per generated token (R = 1, the first prompt,
prefill included), by phase, for dspec's engines and vLLM plain (in its own process, as
:func:`benchmarks.vllm_worker.step_profile` says). The JSON goes to ``--json``, the table (CPU
named) to stdout and next to the JSON as ``.md``.
``other_cores`` in the JSON is the CPU that processes other than the one measured took during each
timed run (the measured engine's own worker processes excluded): above ~0.1 the run was disturbed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.vllm_worker import MARK, step_profile
from dspec_cli.checkpoints.loading import load_drafter
from dspec_cli.core.cpu_load import busy_seconds
from dspec_cli.core.data import load_prompts
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.target import DEFAULT_TARGET_PATH, Target
from dspec_cli.workflows.export import export

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("vllm_worker.py")
PLAIN = "plain"
COMPILED = " compiled"  # suffix of dspec engines run with --graphs compile
SETTLE_S = 1.5  # pause before each timed run: vLLM's worker busy-waits for 1 s after its last step
# vLLM speculative configs by name (--vllm-spec NAME): its n-gram (prompt-lookup) drafter, γ = 7 as dspec's
VLLM_SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 4, "prompt_lookup_min": 2}}


def cpu_description() -> str:
    """"AMD EPYC family 25 model 17, AVX-512 + AVX512-BF16, 2 vCPUs" from /proc/cpuinfo."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    isa = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16"))
           if flag in flags] or (["AVX2"] if "avx2" in flags else [])
    return (f"{info.get('model name', platform.machine())} family {info.get('cpu family', '?')} model "
            f"{info.get('model', '?')}, {' + '.join(isa) or 'no AVX'}, {os.cpu_count()} vCPUs")


def workload_options(ap: argparse.ArgumentParser) -> None:
    """The options naming a run's workload (prompt sets and slice, tokens, R and T values), shared
    with :mod:`benchmarks.batch_invariance`."""
    ap.add_argument("--dataset", action="append", required=True, help="prompt set (jsonl of turns); repeatable")
    ap.add_argument("--num-prompts", type=int, default=4, help="prompts per set")
    ap.add_argument("--skip", type=int, default=0, help="start at this prompt of each set (a held-out slice)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,8", help="R values, comma-separated")
    ap.add_argument("--temperature", default="0,1", help="T values, comma-separated")


def held_out_prompts(target: Target, paths: list[str], skip: int, num: int) -> tuple[list[list[int]], list[dict]]:
    """Prompts ``skip``.. ``skip + num - 1`` of each set, rendered by the target's chat template, and
    what was taken from each set (for the report)."""
    prompts, sets = [], []
    for path in paths:
        chosen = load_prompts(path)[skip : skip + num]
        prompts += [target.render_prompt(p.text) for p in chosen]
        sets.append({"dataset": Path(path).name, "prompts": f"{skip}..{skip + len(chosen) - 1}"})
    return prompts, sets


def _tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` and its descendants (Linux /proc; 0 elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue
    return total


class VllmEngine:
    """One vLLM configuration in a worker subprocess (:mod:`benchmarks.vllm_worker`)."""

    def __init__(self, name: str, python: str, spec: str | None, max_batch: int, log: Path, in_process: bool = False):
        self.name = name
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
        iomp = Path(python).parents[1] / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
        cmd = [python, str(WORKER), "--target", str(DEFAULT_TARGET_PATH), "--max-batch", str(max_batch)]
        cmd += (["--spec", spec] if spec else []) + (["--in-process"] if in_process else [])
        self._log = log.open("a")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env)
        self._read()  # ready

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"vLLM worker {self.name} exited (log: {self._log.name})")

    def _ask(self, req: dict) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run(self, prompts: list[list[int]], new: int, temperature: float, rows: int) -> dict:
        out = self._ask({"prompts": prompts, "max_new_tokens": new, "temperature": temperature, "concurrency": rows})
        spec = out["spec"]
        drafts = spec.get("num_drafts", 0)
        out["tau"] = 1 + spec.get("num_accepted_tokens", 0) / drafts if drafts else None
        return out

    def profile(self, prompt: list[int], new: int, temperature: float) -> dict:
        return self._ask({"prompts": [prompt], "max_new_tokens": new, "temperature": temperature, "concurrency": 1,
                          "profile": True})

    def cpu_seconds(self) -> float:
        return _tree_cpu_seconds(self.proc.pid)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


@dataclass
class DspecEngine:
    """dspec's engine with one drafter (None: plain decoding); an engine per (N, T, R) cell, kept."""

    name: str
    target: Target
    drafter: object | None
    graphs: str = "auto"
    engines: dict = field(default_factory=dict)

    def run(self, prompts: list[list[int]], new: int, temperature: float, rows: int) -> dict:
        key = (new, temperature, rows)
        if key not in self.engines:
            cfg = GenerationConfig(max_new_tokens=new, temperature=temperature, block_size=7, max_batch=rows, seed=0,
                                   graphs=self.graphs)
            self.engines[key] = SpeculativeEngine(self.target, self.drafter, cfg, stop_ids=[])  # pyright: ignore[reportArgumentType]
        engine = self.engines[key]
        t0 = time.perf_counter()
        results = engine.generate(prompts)
        seconds = time.perf_counter() - t0
        rounds = sum(len(r.accepted) for r in results)
        tau = (sum(sum(r.accepted) for r in results) + rounds) / rounds if self.drafter is not None else None
        return {"seconds": seconds, "token_ids": [r.output_ids for r in results], "tau": tau,
                "tokens": sum(len(r.output_ids) for r in results)}

    def profile(self, prompt: list[int], new: int, temperature: float) -> dict:
        """:func:`~benchmarks.vllm_worker.step_profile` of one request (R = 1)."""
        self.run([prompt], new, temperature, 1)  # the engine for this cell, warm
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = self.run([prompt], new, temperature, 1)
        return step_profile(prof.events(), out["seconds"], out["tokens"])

    def cpu_seconds(self) -> float:
        return 0.0  # in this process: counted as "ours" by the caller

    def close(self) -> None:
        pass


def _timed(engine, others: list, prompts, new: int, temperature: float, rows: int) -> dict:
    """One timed run of ``engine`` with the CPU the rest of the machine took meanwhile."""
    own0, idle0, busy0 = _own_seconds(engine), sum(o.cpu_seconds() for o in others), busy_seconds()
    out = engine.run(prompts, new, temperature, rows)
    own1, idle1, busy1 = _own_seconds(engine), sum(o.cpu_seconds() for o in others), busy_seconds()
    wall = out["seconds"]
    if busy0 is not None and busy1 is not None:
        out["other_cores"] = round(max((busy1 - busy0) - (own1 - own0), 0.0) / wall, 3)
        out["idle_engines_cores"] = round((idle1 - idle0) / wall, 3)  # the other engines' processes, idle
    out["tokens"] = sum(len(t) for t in out["token_ids"])
    out["tokens_per_s"] = out["tokens"] / wall
    return out


def _own_seconds(engine) -> float:
    t = os.times()
    return t.user + t.system + engine.cpu_seconds()


def _summary(runs: list[dict], names: list[str], temps: list[float], rows_list: list[int]) -> list[dict]:
    """Per (engine, T, R): median tokens/s and range, τ, ratio to vLLM plain per repeat, greedy identity."""
    out = []
    for temp in temps:
        for rows in rows_list:
            cell = [r for r in runs if r["temperature"] == temp and r["concurrency"] == rows]
            base = {r["repeat"]: r for r in cell if r["engine"] == f"vllm-{PLAIN}"}
            for name in names:
                plain = next((r["token_ids"] for r in cell if r["engine"] == _plain_of(name)), None)
                mine = [r for r in cell if r["engine"] == name]
                if not mine:
                    continue
                tps = [r["tokens_per_s"] for r in mine]
                ratios = [r["tokens_per_s"] / base[r["repeat"]]["tokens_per_s"] for r in mine if r["repeat"] in base]
                taus = [r["tau"] for r in mine if r.get("tau") is not None]
                row = {"engine": name, "temperature": temp, "concurrency": rows, "tokens_per_s": statistics.median(tps),
                       "tokens_per_s_range": [min(tps), max(tps)], "tau": statistics.mean(taus) if taus else None,
                       "vs_vllm_plain": statistics.median(ratios) if ratios else None,
                       "vs_vllm_plain_range": [min(ratios), max(ratios)] if ratios else None,
                       "other_cores_max": max(r.get("other_cores", 0.0) for r in mine)}
                if temp == 0 and plain is not None:
                    same = [a == b for a, b in zip(mine[0]["token_ids"], plain, strict=True)]
                    row["greedy_identical_to_dspec_plain"] = f"{sum(same)}/{len(same)}"
                out.append(row)
    return out


def _plain_of(name: str) -> str:
    """The engine whose greedy output ``name``'s is compared with: dspec plain in the same graph
    mode (vLLM's engines: dspec plain, eager)."""
    return f"dspec-{PLAIN}{COMPILED if name.startswith('dspec-') and name.endswith(COMPILED) else ''}"


def table(summary: list[dict]) -> str:
    head = ("| engine | T | R | tokens/s, median (range) | τ | vs vLLM plain, median (range) | T = 0 identical to dspec plain |\n"
            "|---|---|---|---|---|---|---|")
    lines = [head]
    for s in summary:
        lo, hi = s["tokens_per_s_range"]
        ratio = "-" if s["vs_vllm_plain"] is None else \
            f"{s['vs_vllm_plain']:.2f}x ({s['vs_vllm_plain_range'][0]:.2f}–{s['vs_vllm_plain_range'][1]:.2f})"
        tau = "-" if s["tau"] is None else f"{s['tau']:.2f}"
        lines.append(f"| {s['engine']} | {s['temperature']:g} | {s['concurrency']} | {s['tokens_per_s']:.0f} "
                     f"({lo:.0f}–{hi:.0f}) | {tau} | {ratio} | {s.get('greedy_identical_to_dspec_plain', '-')} |")
    return "\n".join(lines)


def compact_table(summary: list[dict]) -> str:
    """Markdown, one row per engine: tokens/s (ratio to vLLM plain) and τ per (T, R) cell, and
    greedy identity with dspec plain (results page)."""
    cells = sorted({(s["temperature"], s["concurrency"]) for s in summary}, key=lambda c: (c[1], c[0]))
    names = list(dict.fromkeys(s["engine"] for s in summary))
    by = {(s["engine"], s["temperature"], s["concurrency"]): s for s in summary}
    head = "| engine | " + " | ".join(f"T = {t:g}, R = {r}: tok/s (vs vLLM plain), τ" for t, r in cells)
    lines = [head + " | T = 0 identical to dspec plain |", "|---" * (len(cells) + 2) + "|"]
    for name in names:
        row, same = [], "-"
        for t, r in cells:
            s = by.get((name, t, r))
            if s is None:
                row.append("-")
                continue
            ratio = "" if s["vs_vllm_plain"] is None else f" ({s['vs_vllm_plain']:.2f}x)"
            row.append(f"{s['tokens_per_s']:.0f}{ratio}" + ("" if s["tau"] is None else f", {s['tau']:.2f}"))
            same = s.get("greedy_identical_to_dspec_plain", same) if t == 0 and r == cells[0][1] else same
        lines.append(f"| {name} | " + " | ".join(row) + f" | {same} |")
    return "\n".join(lines)


def profile_table(profiles: dict[str, dict]) -> str:
    """Markdown: ms per generated token by phase, one column per profiled engine and T."""
    phases = sorted({k for p in profiles.values() for k in p} - {"total"}) + ["total"]
    lines = ["| ms per token | " + " | ".join(profiles) + " |", "|---" * (len(profiles) + 1) + "|"]
    lines += [f"| {ph} | " + " | ".join(f"{p.get(ph, 0.0):.2f}" for p in profiles.values()) + " |" for ph in phases]
    return "\n".join(lines)


def _vllm_specs(a, target: Target, folder: Path) -> list[tuple[str, str | None]]:
    """(name, speculative_config JSON) of vLLM's engines: plain, --vllm-export's drafters written
    under ``folder``, --vllm-spec's."""
    specs: list[tuple[str, str | None]] = [(PLAIN, None)]
    for name in a.vllm_export:
        drafter = load_drafter(name, target, None, 7)
        report = export(drafter, target, "vllm", folder / name, str(DEFAULT_TARGET_PATH))
        specs.append((f"{name}-export", json.dumps(report["speculative_config"])))
    for spec in a.vllm_spec:
        name, _, config = spec.partition("=")
        if not config and name not in VLLM_SPECS:
            raise SystemExit(f"--vllm-spec {name}: not one of {', '.join(VLLM_SPECS)}; give NAME=JSON")
        specs.append((name, config or json.dumps(VLLM_SPECS[name])))
    return specs


def _profiles(engines: list, a, prompt: list[int], temps: list[float]) -> dict:
    """Per engine and T: where one request's time goes (ms per token by phase, prefill included).
    vLLM's plain engine is profiled in its own in-process worker."""
    out: dict[str, dict] = {}
    for e in engines:
        target = e if isinstance(e, DspecEngine) else None
        if target is None and e.name != f"vllm-{PLAIN}":
            continue
        if target is None:
            e = VllmEngine(f"vllm-{PLAIN} (in-process)", a.vllm_python, None, 1, a.json.with_suffix(".vllm.log"),
                           in_process=True)
        try:
            for temp in temps:
                out[f"{e.name} T={temp:g}"] = e.profile(prompt, a.max_new_tokens, temp)
        finally:
            if target is None:
                e.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    workload_options(ap)
    ap.add_argument("--drafter", action="append", default=[], help="dspec drafter spec besides plain; repeatable")
    ap.add_argument("--vllm-spec", action="append", default=[], metavar="NAME[=JSON]",
                    help=f"a vLLM speculative_config besides plain: {', '.join(VLLM_SPECS)} or NAME=JSON; repeatable")
    ap.add_argument("--vllm-export", action="append", default=[], metavar="DRAFTER",
                    help="dspec's drafter exported for vLLM (dspec export --format vllm); repeatable")
    ap.add_argument("--vllm-python", default=str(ROOT / ".cache" / "vllm-venv" / "bin" / "python"))
    ap.add_argument("--no-vllm", action="store_true", help="dspec only (ratios need vLLM)")
    ap.add_argument("--threads", type=int, default=None, help="dspec's torch threads (default: torch's, one per core)")
    ap.add_argument("--graphs", default="auto",
                    help="dspec's graph modes, comma-separated (GenerationConfig.graphs: auto, eager, compile); "
                         "each dspec engine runs in each, compiled ones named '... compiled'")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true",
                    help="also profile one request per engine at R = 1 (ms per token by phase; vLLM in-process)")
    ap.add_argument("--json", required=True, type=Path)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    temps = [float(t) for t in a.temperature.split(",")]
    rows_list = [int(r) for r in a.concurrency.split(",")]

    target = Target.load(None, dtype="bfloat16")
    prompts, sets = held_out_prompts(target, a.dataset, a.skip, a.num_prompts)
    engines: list = [  # a drafter per engine: one shared by an eager and a compiled engine slowed the eager one
        DspecEngine(f"dspec-{spec}{COMPILED if mode == 'compile' else ''}", target,
                    None if spec == PLAIN else load_drafter(spec, target, None, 7), mode)
        for mode in a.graphs.split(",") for spec in (PLAIN, *a.drafter)]
    exports = tempfile.TemporaryDirectory(prefix="dspec-vs-vllm-")
    runs: list[dict] = []
    warmup: list[dict] = []  # seconds of each engine's first calls per cell (compilation included)
    try:
        if not a.no_vllm:
            log = a.json.with_suffix(".vllm.log")
            engines += [VllmEngine(f"vllm-{name}", a.vllm_python, spec, max(rows_list), log)
                        for name, spec in _vllm_specs(a, target, Path(exports.name))]
        names = [e.name for e in engines]
        for e in engines:  # warm-up: first calls (compilation), allocations, caches sized for the run
            for temp in temps:
                for rows in rows_list:
                    t0 = time.perf_counter()
                    e.run(prompts[:rows], a.max_new_tokens, temp, rows)
                    e.run(prompts, a.max_new_tokens, temp, rows)  # every prompt's windows seen once
                    warmup.append({"engine": e.name, "temperature": temp, "concurrency": rows,
                                   "seconds": round(time.perf_counter() - t0, 1)})
                    print(f"warm-up T={temp:g} R={rows} {e.name}: {warmup[-1]['seconds']} s", flush=True)
        for rep in range(a.repeats):
            for temp in temps:
                for rows in rows_list:
                    order = engines[rep % len(engines):] + engines[: rep % len(engines)]
                    for e in order:
                        others = [o for o in engines if o is not e]
                        time.sleep(SETTLE_S)
                        out = _timed(e, others, prompts, a.max_new_tokens, temp, rows)
                        runs.append({"engine": e.name, "repeat": rep, "temperature": temp, "concurrency": rows, **out})
                        print(f"repeat {rep} T={temp:g} R={rows} {e.name}: {out['tokens_per_s']:.1f} tok/s"
                              f" (other cores {out.get('other_cores', '?')})", flush=True)
        profiles = _profiles(engines, a, prompts[0], temps) if a.profile else {}
    finally:
        for e in engines:
            e.close()
        exports.cleanup()
    summary = _summary(runs, names, temps, rows_list)
    report = {
        "cpu": cpu_description(), "torch": torch.__version__, "threads": torch.get_num_threads(), "graphs": a.graphs,
        "dtype": "bfloat16", "target": "embedded tiny-target (Qwen3, 6 layers, hidden 256)", "prompt_sets": sets,
        "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "vllm": {"python": a.vllm_python,
        "setup": "vllm-cpu, enforce_eager, libiomp5 preloaded, its own thread binding"}, "summary": summary,
        "step_profile_ms_per_token": profiles, "warmup": warmup, "runs": runs,
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(report, indent=1))
    text = (f"CPU: {report['cpu']}; torch {report['torch']}, {report['threads']} threads, bfloat16; "
            f"{len(prompts)} prompts ({', '.join(s['dataset'] + ' ' + s['prompts'] for s in sets)}) x "
            f"{a.max_new_tokens} tokens, {a.repeats} interleaved repeats\n\n{compact_table(summary)}\n\n"
            f"{table(summary)}\n")
    if profiles:
        text += "\n" + profile_table(profiles) + "\n"
    a.json.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

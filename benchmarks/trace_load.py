"""Serving under load on a random-init target, acceptance replayed from recorded traces (not a test).

    python -m benchmarks.trace_load --traces TRACES.jsonl [--calibration calibration.json]
        [--shape qwen3-4b] [--device cuda] [--concurrency 1,4,16,64]
        [--scheduler fixed --scheduler hardware --scheduler async] [--cost-table PATH]
        [--cost-table-out PATH] [--max-new-tokens 48] [--repeats 1] [--json PATH] [--plots DIR]

A random-init target has the speed of the real model but no drafter can predict it, so the
acceptance of a trained drafter is replayed. Everything that costs
time is real; only the accept/reject decisions come from the traces:

- Every round runs a random-init ``dspark-markov`` drafter of the shape's settings on the
  target's taps, so drafting costs what it would, and proposes its tokens.
- Each row draws one recorded round (``dspec calibrate --save-traces``: a trained drafter's raw
  confidences c_1..c_γ and its accepted count a, from rounds verified to the full block) at
  random, independently per row and round; the proposal carries the recorded confidences.
- The scheduler picks ℓ from them (with --calibration applied, as in serving), the target
  verifies the ℓ + 1 tokens of every row in one real forward, and before the greedy verifier
  reads the logits the draft token at positions 1..min(a, ℓ) is made the argmax and the one at
  a + 1 the minimum: greedy verification accepts exactly min(a, ℓ) drafts, the caches commit
  them and the bonus token is the target's own.
- Decoding is greedy, stop tokens are off (every request makes --max-new-tokens tokens),
  prompts are random token ids of random length. The cost table is profiled on the same
  target (or read with --cost-table).

Reports the same metrics as ``dspec bench --concurrency`` (JSON, a markdown table, the load
PNGs) and the τ the traces give for full-length verification (the fixed scheduler must match it).
Speeds are the median of --repeats timed passes that follow one untimed full pass per engine
(the draft/verify time shares come from that pass).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.drafter_latency import build_target
from benchmarks.table import load_table
from dspec_cli.core.calibration import Calibration
from dspec_cli.core.hardware import CostTable
from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.core.specs import parse_scheduler_spec
from dspec_cli.core.types import Proposal, Sampler
from dspec_cli.runtime.drafter import Drafter, DraftState, WrappedDrafter
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.schedule import build_scheduler
from dspec_cli.runtime.target import Target, TargetBatch
from dspec_cli.workflows.bench import (
    environment,
    paired_metrics,
    prompt_units,
    run_paired,
    warm_up,
)
from dspec_cli.workflows.calibrate import Rounds, load_traces
from dspec_cli.workflows.target_profile import profile_target

PROFILE_GRID = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def force_greedy(logits: torch.Tensor, ids: torch.Tensor, accepted: torch.Tensor) -> None:
    """In place: make greedy verification of the padded chains accept ``accepted`` drafts per row.

    logits [n, 1 + W, V] of the verify pass over ids [n, 1 + W] (anchor, drafts), accepted [R]
    (R <= n; rows past R are padding): draft k + 1 <= accepted[r] becomes the argmax of position
    k, draft accepted[r] + 1 (if verified) the minimum.
    """
    R, W = accepted.shape[0], ids.shape[1] - 1
    if W == 0:
        return
    k = torch.arange(W, device=logits.device)
    a = accepted.to(logits.device)[:, None]  # [R, 1]
    part = logits[:R, :W]  # [R, W, V]: position k verifies draft k + 1
    nxt = ids[:R, 1:, None].to(logits.device)  # [R, W, 1]
    value = torch.where((k < a)[..., None], part.amax(-1, keepdim=True) + 1, part.amin(-1, keepdim=True) - 1)
    part.scatter_(-1, nxt, torch.where((k <= a)[..., None], value, part.gather(-1, nxt)))


class ReplayTarget(Target):
    """The same model; each verify pass is forced to the acceptance the replay drafter drew (in
    Python per round: the engines run eagerly, ``graphs="eager"``)."""

    def __init__(self, base: Target):
        self.__dict__.update(base.__dict__)
        self.forced: torch.Tensor | None = None  # [R] accepted drafts for the next verify

    def score(self, batch: TargetBatch, ids: torch.Tensor, parents: torch.Tensor | None, window: int,
              dense: bool = False, upcast: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        logits, taps = super().score(batch, ids, parents, window, dense)  # float, whatever ``upcast``: forced exactly
        if self.forced is not None and parents is None:
            force_greedy(logits, ids, self.forced)
            self.forced = None
        return logits, taps


class TraceReplayDrafter(WrappedDrafter):
    """``base`` drafts (its real cost and tokens); confidences and acceptance come from ``rounds``."""

    name = "trace-replay"

    def __init__(self, base: Drafter, target: ReplayTarget, rounds: Rounds, generator: torch.Generator):
        super().__init__(base.config, target)
        full = rounds.verified == rounds.block_size  # rounds verified to the end: a is not truncated
        if not bool(full.any()):
            raise ValueError("traces: no round was verified to the full block")
        self.base = base
        self.confidence_table = rounds.confidence[full].float()  # [N, γ]
        self.accepted_table = rounds.accepted[full]  # [N]
        self.generator = generator

    @property
    def full_tau(self) -> float:
        """τ of full-length verification over the replayed rounds (the fixed scheduler's)."""
        return float(self.accepted_table.float().mean()) + 1

    @torch.no_grad()
    def propose(self, state: DraftState, anchors: torch.Tensor, max_len: int, sampler: Sampler) -> Proposal:
        proposal = self.base.propose(state, anchors, max_len, sampler)
        pick = torch.randint(len(self.accepted_table), (anchors.shape[0],), generator=self.generator)
        gamma = proposal.tokens.shape[1]
        self.target.forced = self.accepted_table[pick].clamp(max=gamma).to(anchors.device)
        return Proposal(tokens=proposal.tokens, lengths=proposal.lengths,
                        confidence=self.confidence_table[pick, :gamma].to(anchors.device))


def random_prompts(n: int, vocab: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=g).tolist()
    return [torch.randint(16, vocab - 16, (s,), generator=g).tolist() for s in sizes]


def cost_drafter(target, layer_ids, mask_id: int, layers: int, rank: int, block: int) -> Drafter:
    cls = get_drafter_class("dspark-markov")
    cfg = cls.config_class(block_size=block, num_layers=layers, target_layer_ids=list(layer_ids),
                           mask_token_id=mask_id, markov_rank=rank)
    drafter = cls.build(cfg, target)
    drafter.net.to(target.device, target.dtype)
    return drafter


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--traces", type=Path, required=True, help="jsonl from `dspec calibrate --save-traces`")
    p.add_argument("--calibration", type=Path, default=None, help="calibration.json applied to the trace confidences")
    p.add_argument("--shape", default="qwen3-4b", help="tiny (the embedded target) or qwen3-4b (random init)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--scheduler", action="append", default=None, help="repeatable (default: fixed, hardware, async)")
    p.add_argument("--cost-table", type=Path, default=None, help="read instead of profiling")
    p.add_argument("--cost-table-out", type=Path, default=None, help="write the profiled table (and a PNG beside it)")
    p.add_argument("--profile-grid", default=",".join(map(str, PROFILE_GRID)))
    p.add_argument("--profile-contexts", default="256,1024")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompt-lengths", default="64,256", help="MIN,MAX random prompt length")
    p.add_argument("--prompts-per-slot", type=int, default=2, help="prompts = max(4, this x R): continuous batching")
    p.add_argument("--repeats", type=int, default=2, help="timed passes per engine, after one untimed full pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plots", type=Path, default=None)
    args = p.parse_args(argv)

    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    levels = [int(c) for c in args.concurrency.split(",")]
    lo, hi = (int(x) for x in args.prompt_lengths.split(","))
    rounds, meta = load_traces(args.traces)
    block = meta["block_size"]
    cal = Calibration.load(args.calibration, drafter=meta["drafter"] or None, block_size=block) if args.calibration else None
    target, layer_ids, mask_id, layers, rank = build_target(args.shape, args.device, dtype, full=True)
    target.model.eval()
    t0 = time.perf_counter()
    if args.cost_table:
        table = CostTable.load(args.cost_table)
    else:
        grid = [int(b) for b in args.profile_grid.split(",")]
        contexts = [int(c) for c in args.profile_contexts.split(",")]
        table = profile_target(target, grid=grid, contexts=contexts, repeats=10, warmup=3,
                               model_name=f"random-init {args.shape}")
        print(f"profiled SPS(B) in {time.perf_counter() - t0:.1f} s", flush=True)
        if args.cost_table_out:
            from dspec_cli.workflows.plots import sps_plot

            table.save(args.cost_table_out)
            sps_plot(table, args.cost_table_out.with_suffix(".png"))
    specs = args.scheduler or ["fixed", "hardware", "async"]
    replay_target = ReplayTarget(target)
    base = cost_drafter(replay_target, layer_ids, mask_id, layers, rank, block)
    replay = TraceReplayDrafter(base, replay_target, rounds, torch.Generator().manual_seed(args.seed))
    replay.calibration = cal  # applied by the engine, as in serving
    prompts = random_prompts(max(4, args.prompts_per_slot * max(levels)), target.config.vocab_size, (lo, hi), args.seed)
    runs = []
    for conc in levels:
        ids = prompts[: max(4, args.prompts_per_slot * conc)]
        cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, block_size=block,
                               max_batch=conc, seed=args.seed, graphs="eager")  # the replay forces acceptance in Python
        engines = [("baseline", "-", SpeculativeEngine(replay_target, None, cfg, stop_ids=()))]
        for spec in specs:
            name, options = parse_scheduler_spec(spec)
            sched = build_scheduler(name, table, **options)
            engines.append(("dspark-replay", spec, SpeculativeEngine(replay_target, replay, cfg, scheduler=sched, stop_ids=())))
        warm_up(engines, ids[:conc])
        # one extra full pass, dropped: on the first H200 sweep the first pass ran up to 2x slower
        # than the second (new shapes), for the baseline and the drafters alike
        timed = [reps[1:] for reps in run_paired(engines, prompt_units(ids, args.seed, conc), args.repeats + 1)]
        for (name, spec, _), reps in zip(engines[1:], timed[1:], strict=True):
            runs.append({
                "drafter": name, "scheduler": spec, "dataset": "random", "concurrency": conc, "num_prompts": len(ids),
                "max_new_tokens": args.max_new_tokens, "temperature": 0.0, "block_size": block,
                **paired_metrics(reps, timed[0], block),
                "trace_tau_full_verification": replay.full_tau,
            })  # fmt: skip
            print(load_table(runs[-1:]).splitlines()[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if args.json:  # after every concurrency: a run cut short keeps what it measured
            report = {"target": f"random-init {args.shape}", "env": environment(target), "traces": str(args.traces),
                      "trace_drafter": meta["drafter"], "calibration": str(args.calibration) if args.calibration else None,
                      "cost_table": table.to_dict(), "runs": runs}
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(load_table(runs))
    if args.plots:
        from dspec_cli.workflows.plots import load_plots

        load_plots(runs, args.plots)


if __name__ == "__main__":
    main()

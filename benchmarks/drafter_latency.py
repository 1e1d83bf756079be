"""Drafter latency micro-benchmark (not a test): one drafting round of DFlash and DSpark.

    python -m benchmarks.drafter_latency [--shape tiny|qwen3-4b] [--blocks 4,8,16]
        [--rows 1] [--context 512] [--layers N] [--device cpu|cuda] [--dtype float32|bfloat16]
        [--json PATH]

Times ``propose`` (one parallel backbone forward, then the per-slot loop: LM head, the
sequential head, sampling) for dflash, dspark-markov and dspark-rnn built on the same random
backbone weights, and the backbone forward alone, so the Markov/RNN head's share of a round
is ``1 - dflash / dspark`` (the paper: +0.2-1.3% per round on GPU). Speed needs no trained
weights: ``tiny`` is the embedded target; ``qwen3-4b`` is a random-init Qwen3-4B-shaped model
(hidden 2560, vocab 151936; only the layers the taps need are built, since a drafting round
never runs the target). Context features are random. Medians of the repeats after warm-up,
synchronising CUDA around each call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.runtime.engine import GenerationConfig, RoundSampler
from dspec_cli.runtime.target import Target
from dspec_cli.workflows.bench import environment

DRAFTERS = ("dflash", "dspark-markov", "dspark-rnn")
SHAPES = {  # name -> (Qwen3Config fields, target_layer_ids, mask token, default drafter layers, markov rank)
    "qwen3-4b": (dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0,
                      num_hidden_layers=36, tie_word_embeddings=True), (1, 9, 17, 25, 33), 151669, 5, 256),
}


def build_target(shape: str, device: str, dtype: torch.dtype, *, full: bool = False
                 ) -> tuple[Target, tuple[int, ...], int, int, int]:
    """(target, target_layer_ids, mask token id, drafter layers, markov rank) for ``shape``;
    random-init shapes get only the layers the taps need unless ``full``."""
    if shape == "tiny":
        return Target.load(None, device=device, dtype=str(dtype).removeprefix("torch.")), (0, 2, 4), 3, 1, 64
    from transformers import AutoModelForCausalLM, Qwen3Config

    fields, layer_ids, mask_id, layers, rank = SHAPES[shape]
    if not full:
        fields = {**fields, "num_hidden_layers": max(layer_ids) + 1}
    cfg = Qwen3Config(**fields, attn_implementation="sdpa")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return Target(model), layer_ids, mask_id, layers, rank


def _time(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn()``."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def measure(target: Target, layer_ids, mask_id: int, layers: int, rank: int, blocks, rows: int, context: int,
            warmup: int, repeats: int) -> list[dict]:
    dev, d = target.device, target.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    hidden = [torch.randn(context, len(layer_ids) * d, generator=gen).to(dev, target.dtype) for _ in range(rows)]
    prompts = [torch.randint(4, target.config.vocab_size, (context,), generator=gen).to(dev) for _ in range(rows)]
    anchors = torch.randint(4, target.config.vocab_size, (rows,), generator=gen).to(dev)
    seeds, rounds = torch.arange(rows, device=dev), torch.zeros(rows, dtype=torch.long, device=dev)
    out = []
    for block in blocks:
        base = None
        for name in DRAFTERS:
            cls = get_drafter_class(name)
            cfg = cls.config_class(block_size=block, num_layers=layers, target_layer_ids=list(layer_ids),
                                   mask_token_id=mask_id, **({} if name == "dflash" else {"markov_rank": rank}))
            drafter = cls.build(cfg, target)
            if base is None:
                base = drafter.net.backbone.state_dict()
            drafter.net.backbone.load_state_dict(base)  # same backbone: the difference is the head
            drafter.net.to(dev, target.dtype)
            state = drafter.init_state()
            drafter.add_requests(state, prompts, hidden)
            def propose(drafter=drafter, state=state, block=block):
                sampler = RoundSampler(GenerationConfig(temperature=1.0), seeds, rounds, block)
                return drafter.propose(state, anchors, block, sampler)

            total = _time(propose, dev, warmup, repeats)
            backbone = _time(lambda drafter=drafter, state=state: drafter.block_hidden(state, anchors), dev, warmup,
                             repeats)
            out.append({"drafter": name, "block_size": block, "rows": rows, "context": context,
                        "propose_ms": total, "backbone_ms": backbone, "loop_ms": total - backbone})
        ref = next(r["propose_ms"] for r in out if r["drafter"] == "dflash" and r["block_size"] == block)
        for r in out:
            if r["block_size"] == block:
                r["vs_dflash"] = r["propose_ms"] / ref - 1
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=("tiny", *SHAPES), default="tiny")
    p.add_argument("--blocks", default="4,8,16")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--layers", type=int, default=None, help="drafter layers (default: 1 tiny, 5 qwen3-4b)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    target, layer_ids, mask_id, layers, rank = build_target(args.shape, args.device, dtype)
    blocks = [int(b) for b in args.blocks.split(",")]
    rows = measure(target, layer_ids, mask_id, args.layers or layers, rank, blocks, args.rows, args.context,
                   args.warmup, args.repeats)
    print(f"{'drafter':<14} {'block':>5} {'propose ms':>11} {'backbone ms':>12} {'loop ms':>8} {'vs dflash':>10}")
    for r in rows:
        print(f"{r['drafter']:<14} {r['block_size']:>5} {r['propose_ms']:>11.3f} {r['backbone_ms']:>12.3f} "
              f"{r['loop_ms']:>8.3f} {100 * r['vs_dflash']:>+9.1f}%")
    if args.json:
        report = {"shape": args.shape, "dtype": str(dtype), "env": environment(target), "runs": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

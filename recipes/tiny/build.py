"""Build the embedded default target and its draft model from offline text, seeded.

    python recipes/tiny/build.py [--stage corpus|tokenizer|target|draft|export|all]
                                 [--install-packages] [--minutes 30] [--draft-minutes 8] [--max-steps N]
                                 [--draft-max-steps N] [--out work-data/tiny]

Stages write under --out: corpus/ (text), tokenizer.json, data/ (uint16 token arrays),
target/ and draft/ (checkpoints + logs); export writes <--assets>/tiny-{target,draft-model}
(default dspec_cli/assets).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

STAGES = ("corpus", "tokenizer", "target", "draft", "export")
ASSET_NAMES = {"target": "tiny-target", "draft": "tiny-draft-model"}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stage_corpus(args) -> None:
    import corpus
    t = time.time()
    stats = corpus.build(args.out, args.seed, install_packages=args.install_packages)
    _log(f"corpus: {len(stats['streams'])} streams, prompts {stats['prompts']}, "
         f"{time.time() - t:.0f}s")


def stage_tokenizer(args) -> None:
    import bpe
    from tokenizers import Tokenizer
    t = time.time()
    if args.tokenizer:  # keep an existing vocabulary (a continued phase of shipped weights)
        tok = Tokenizer.from_file(str(args.tokenizer))
        tok.save(str(args.out / "tokenizer.json"))
        _log(f"tokenizer: reusing {args.tokenizer}")
    else:
        tok = bpe.train_tokenizer(args.out / "corpus", args.out / "tokenizer.json")
        _log(f"tokenizer trained in {time.time() - t:.0f}s")
    stats = bpe.encode_corpus(tok, args.out / "corpus", args.out / "data")
    _log("encoded: " + ", ".join(f"{k} {v['tokens']}" for k, v in stats.items()))


def stage_train(args, size: str, minutes: float, max_steps: int | None) -> None:
    import train
    init_from = None
    if args.init_from:
        init_from = args.init_from / ASSET_NAMES[size]
        if not (init_from / "train_state.json").exists():
            raise SystemExit(f"error: --init-from needs {init_from / 'train_state.json'}")
    elif args.continue_training:
        final = args.out / size / "final"
        if not final.exists():
            raise SystemExit(f"error: --continue needs {final}")
        init_from = final.with_name(f"phase{len(list(final.parent.glob('phase*'))) + 1}")
        final.rename(init_from)
    train.train(size=size, out_dir=args.out / size, data_dir=args.out / "data",
                tokenizer_file=args.out / "tokenizer.json", minutes=minutes,
                max_steps=max_steps, seed=args.seed, bf16=_use_bf16(args),
                init_from=init_from)


def _use_bf16(args) -> bool:
    """bf16 autocast unless --fp32, or where the CPU has no native bf16 matmul (there the
    fallback is two orders of magnitude slower than float32)."""
    from dspec_cli.core.hardware import cpu_native_half
    if args.fp32:
        return False
    if cpu_native_half(torch.bfloat16) is False:
        _log("this CPU has no native bf16 matmul (avx512_bf16 / amx_bf16): training in float32")
        return False
    return True


def stage_export(args) -> None:
    import export
    assets = args.assets
    for size, name in ASSET_NAMES.items():
        if (args.out / size / "final").exists():
            export.export(size=size, run_dir=args.out / size, data_dir=args.out / "data",
                          tokenizer_file=args.out / "tokenizer.json", dest=assets / name,
                          seed=args.seed)
            _log(f"exported {size} -> {assets / name}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", choices=STAGES + ("all",), default="all")
    p.add_argument("--minutes", type=float, default=30.0, help="target training budget (wall)")
    p.add_argument("--draft-minutes", type=float, default=8.0, help="draft training budget")
    p.add_argument("--max-steps", type=int, default=None,
                   help="target: stop after this many steps as well (deterministic runs)")
    p.add_argument("--draft-max-steps", type=int, default=None,
                   help="draft: stop after this many steps as well (deterministic runs)")
    p.add_argument("--out", type=Path, default=REPO / "work-data" / "tiny")
    p.add_argument("--assets", type=Path, default=REPO / "dspec_cli" / "assets",
                   help="export: folder that receives tiny-target/ and tiny-draft-model/")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--install-packages", action="store_true",
                   help="corpus: install the missing Debian text packages with apt-get (needs root); "
                        "without it a missing package stops the stage, naming the packages")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer stage: encode with this tokenizer.json instead of training one")
    p.add_argument("--fp32", action="store_true",
                   help="disable bf16 autocast (off anyway on CPUs without native bf16)")
    p.add_argument("--continue", dest="continue_training", action="store_true",
                   help="target/draft: continue from <out>/<size>/final for another budget")
    p.add_argument("--init-from", type=Path, default=None,
                   help="target/draft: continue from the exported weights in this assets folder "
                        "(tiny-target/, tiny-draft-model/ with their train_state.json)")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.draft_minutes <= 0:
        raise SystemExit("error: --minutes and --draft-minutes must be > 0")
    args.out, args.assets = args.out.resolve(), args.assets.resolve()
    if args.init_from:
        args.init_from = args.init_from.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    _log(f"args: {json.dumps({k: str(v) for k, v in vars(args).items()})}")
    todo = STAGES if args.stage == "all" else (args.stage,)
    for stage in todo:
        if stage == "corpus":
            stage_corpus(args)
        elif stage == "tokenizer":
            stage_tokenizer(args)
        elif stage == "target":
            stage_train(args, "target", args.minutes, args.max_steps)
        elif stage == "draft":
            stage_train(args, "draft", args.draft_minutes, args.draft_max_steps)
        else:
            stage_export(args)


if __name__ == "__main__":
    main()

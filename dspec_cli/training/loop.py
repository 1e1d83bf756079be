"""The training loop shared by every trainable drafter (docs/training.md).

Per optimizer step, each rank takes its share of the step's ``global_batch`` samples (see
:class:`~dspec_cli.training.data.DataOrder`), runs the frozen target on each micro-batch (no grad)
for the drafter's features, calls ``drafter.training_loss`` and accumulates gradients. With
several processes the loss runs inside torch's DistributedDataParallel (a module whose forward is
``training_loss``, so it may use any submodule of ``drafter.net``): micro-batches accumulate under
``no_sync`` and the last one's backward averages the gradients across ranks. Gradients are then
clipped, and AdamW + warmup/cosine take the step. Rank 0 logs and writes checkpoints.

A run is a pure function of (recipe, data, world size): the data order depends only on the seed
and the step, and checkpoints carry optimizer, scheduler and every RNG state, so a resumed run
produces the same weights as an uninterrupted one. SIGINT/SIGTERM stop at the next step
boundary with a checkpoint (a second Ctrl-C aborts at once).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from dspec_cli.checkpoints.model_card import write_model_card
from dspec_cli.checkpoints.native import weights_fingerprint
from dspec_cli.checkpoints.persist import trained_weights
from dspec_cli.checkpoints.serving import describe, serving_methods
from dspec_cli.core import plugins
from dspec_cli.core.chat_template import warn_if_other
from dspec_cli.core.devices import resolve_device
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import CHECKPOINT_READS, EMBEDDED, expect_folder
from dspec_cli.core.jsonl import write_line
from dspec_cli.core.outputs import ensure_folder, is_special, open_append
from dspec_cli.core.process_exit import request_exit_without_finalization
from dspec_cli.core.run_paths import RunPaths
from dspec_cli.core.specs import parse_drafter_spec
from dspec_cli.runtime.drafter import TrainableDrafter
from dspec_cli.runtime.target import Target
from dspec_cli.training import sharding
from dspec_cli.training.data import (
    DataOrder,
    FeatureCache,
    Features,
    TrainData,
    load_train_data,
)
from dspec_cli.training.recipes import (
    Recipe,
    apply_overrides,
    describe_changes,
    load_recipe,
    override_labels,
    resume_conflicts,
)
from dspec_cli.training.report_to import Reporters, check
from dspec_cli.training.sharding import full_norm, gathered, shard
from dspec_cli.training.state import (
    capture_rng,
    latest_checkpoint,
    load_checkpoint,
    read_state,
    restore_rng,
    save_checkpoint,
    seed_all,
    trim_log,
)

LOG_NAME = "train_log.jsonl"
_CARD_SKIP = ("step", "epoch", "lr", "step_s", "tokens", "tokens_per_s")  # log fields left off the model card


@dataclass
class TrainOptions:
    recipe: str | Path | None = None  # TOML recipe (optional with --resume: the checkpoint's own)
    drafter: str | None = None  # default: the recipe's [drafter] name
    overrides: Sequence[str] = ()  # "section.key=value"
    output: str | Path | None = None  # default: runs/<recipe folder>-<drafter>
    target: str | None = None  # must agree with the recipe's target.name when given
    resume: bool = False
    max_steps: int | None = None  # = override train.max_steps
    stop_after: int | None = None  # stop (with a checkpoint) once this many steps are done
    json_log: str | Path | None = None  # default: OUT/train_log.jsonl
    feature_cache: str | Path | None = None
    init_from: str | Path | None = None  # a drafter checkpoint to fine-tune (fresh optimizer and schedule)
    report_to: Sequence[str] = ()  # trackers besides the JSONL log: "tensorboard" (OUT/tensorboard)
    chat_template_kwargs: dict | None = None  # replaces the recipe's [chat_template] table when given


@dataclass
class TrainResult:
    output: Path
    step: int  # optimizer steps done
    total_steps: int
    finished: bool  # False when stopped early (stop_after or a signal); --resume continues
    metrics: dict = field(default_factory=dict)  # last logged row
    checkpoint: Path | None = None
    interrupted: bool = False  # stopped by SIGINT / SIGTERM (the CLI exits 130)


class Progress(Protocol):
    def start(self, total: int, done: int, title: str) -> None: ...
    def update(self, row: dict) -> None: ...
    def note(self, text: str) -> None: ...


class _Silent:
    def start(self, total: int, done: int, title: str) -> None:
        pass

    def update(self, row: dict) -> None:
        pass

    def note(self, text: str) -> None:
        pass


@dataclass
class Rank:
    rank: int = 0
    world: int = 1
    owns_group: bool = False  # this call initialised torch.distributed

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def train(opts: TrainOptions, progress: Progress | None = None) -> TrainResult:
    """Train (or resume) a drafter; returns where the result is. Errors are DspecError."""

    check(opts.report_to)
    recipe, drafter_cls, out, resume_from, paths = _prepare(opts)
    try:
        rank, device = _init_distributed(recipe.train.device)
    except BaseException:
        paths.release()
        raise
    try:
        return _Run(opts, recipe, drafter_cls, out, resume_from, rank, device, progress or _Silent()).run()
    finally:
        paths.release()
        if rank.owns_group:
            gloo = dist.get_backend() == "gloo"
            dist.destroy_process_group()
            if gloo:  # its worker threads outlive the group (see core/process_exit.py)
                request_exit_without_finalization("gloo worker threads outlive the process group")


def _prepare(opts: TrainOptions) -> tuple[Recipe, type, Path, Path | None, RunPaths]:
    """Cheap checks before anything loads or is written: recipe, drafter, output, checkpoint, data."""
    out = Path(opts.output) if opts.output is not None else None
    overrides = list(opts.overrides) + ([f"train.max_steps={opts.max_steps}"] if opts.max_steps is not None else [])
    if opts.max_steps is not None and opts.max_steps < 1:
        raise DspecError(f"--max-steps must be >= 1, got {opts.max_steps}")
    if opts.stop_after is not None and opts.stop_after < 1:
        raise DspecError(f"--stop-after must be >= 1, got {opts.stop_after}")
    if opts.resume and opts.init_from is not None:
        raise DspecError("--init-from starts a new run from a drafter's weights; --resume continues a run: use one")
    if opts.init_from is not None:
        expect_folder(opts.init_from, "--init-from", "checkpoint folder")
    resume_from = None
    if opts.resume:
        if out is None:
            raise DspecError("--resume needs --output (the folder of the run to continue)")
        if out.exists():
            expect_folder(out, "--resume --output", "run folder")
        resume_from = latest_checkpoint(out)
        if resume_from is None and out.is_dir() and any(out.iterdir()):
            raise DspecError(f"--resume: {out} holds no checkpoint (checkpoints/latest) to continue from")
    saved = None
    if resume_from is not None:
        saved = Recipe.from_dict(_read_json(resume_from / "recipe.json"), source=str(resume_from / "recipe.json"))
    labels = {**override_labels(opts.overrides), **(
        {"train.max_steps": f"--max-steps {opts.max_steps}"} if opts.max_steps is not None else {})}
    if opts.recipe is not None:
        recipe = load_recipe(opts.recipe, overrides, labels)
    elif saved is not None:
        recipe = Recipe.from_dict(apply_overrides(saved.to_dict(), overrides), source=saved.source, labels=labels)
    elif opts.resume:
        raise DspecError(f"--resume: {out} holds no run to continue; start one with --recipe RECIPE")
    else:
        raise DspecError("--recipe is required (it may be omitted only with --resume of an existing run)")
    if opts.chat_template_kwargs is not None:
        recipe.chat_template = dict(opts.chat_template_kwargs)
    name = opts.drafter or recipe.drafter
    if not name:
        raise DspecError(f"give --drafter: recipe {recipe.source} names no drafter ([drafter] name)")
    cls, options = parse_drafter_spec(name)
    if options:
        raise DspecError(f"--drafter {name!r}: training takes the drafter's options from the recipe; "
                         f"give them as overrides (drafter.{next(iter(options))}=...)")
    if recipe.drafter and plugins.get_drafter_class(recipe.drafter) is not cls:
        raise DspecError(f"recipe {recipe.source} is for drafter {recipe.drafter!r}, not {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, TrainableDrafter)):
        raise DspecError(f"drafter {name!r} is not trainable (it has no weights to train)")
    recipe.drafter = cls.name
    recipe.drafter_config(cls)  # [drafter] keys and types, before anything loads
    if opts.target is not None and not _same_target(opts.target, recipe.target.name):
        raise DspecError(
            f"recipe {recipe.source} is for target {recipe.target.name!r}, not {opts.target!r} "
            f"(use a recipe for that target, or override target.name={opts.target})"
        )
    if resume_from is not None and saved is not None:  # saved: the recipe read with resume_from
        state = read_state(resume_from)
        if state.get("drafter") != cls.name:
            raise DspecError(
                f"--resume: {resume_from} is a {state.get('drafter')!r} checkpoint, not {cls.name!r}"
            )
        conflicts = resume_conflicts(saved, recipe)
        if conflicts and opts.recipe is None:  # the checkpoint's own recipe, changed by overrides / --max-steps
            raise DspecError(
                f"--resume: {describe_changes(saved, recipe, conflicts)} would make the run differ from one never "
                f"interrupted; resume without changing them, or start a new run from its weights with "
                f"--init-from {resume_from}"
            )
        if conflicts:
            raise DspecError(
                f"--resume: the recipe differs from the checkpoint's in {describe_changes(saved, recipe, conflicts)} "
                "(resume with the original settings, or omit --recipe to reuse the checkpoint's)"
            )
    if out is None:
        stem = Path(recipe.source).parent.name if recipe.source.endswith(".toml") else "run"
        out = Path("runs") / f"{stem}-{cls.name}"
    out_option = "--output" if opts.output is not None else "the run folder (--output's default)"
    default_log = opts.json_log is not None and os.path.realpath(opts.json_log) == os.path.realpath(out / LOG_NAME)
    paths = RunPaths().read("--recipe", opts.recipe).read("--init-from", opts.init_from, names=CHECKPOINT_READS) \
        .read("data.path of the recipe", *recipe.data.paths).read("--target", opts.target) \
        .write_folder(out_option, out).write("--json-log", None if default_log else opts.json_log, stream=True) \
        .write_folder("--feature-cache", opts.feature_cache).check()
    try:
        if not opts.resume and out.is_dir() and any(out.iterdir()):
            raise DspecError(f"{out_option} {out}: folder is not empty; use --resume to continue that run, or "
                             "another folder")
        if not opts.resume and opts.json_log is not None and Path(opts.json_log).is_file() and not is_special(opts.json_log):
            raise DspecError(f"--json-log {opts.json_log} already exists; remove it or choose another path")
        for i, path in enumerate(recipe.data.paths or [""]):
            if not Path(path).is_file():
                raise DspecError(f"training data {path!r} (data.path) not found{_data_hint(recipe, i, path)}")
    except DspecError:
        paths.release()
        raise
    return recipe, cls, out, resume_from, paths


def _data_hint(recipe: Recipe, i: int, path: str) -> str:
    """How to create the ``i``-th data file of a recipe: its first file with the recipe's
    [regenerate] settings, the others with the options its header comment gives."""
    if not (recipe.regenerate.prompts and recipe.source.endswith(".toml")):
        return ""
    if i == 0:
        return f"; create it with `dspec data regenerate --recipe {recipe.source}`"
    return (f"; create it with `dspec data regenerate --recipe {recipe.source} --output {path}` and the sampling "
            f"options given at the top of {recipe.source}")


def _same_target(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = Path(a), Path(b)
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DspecError(f"{path}: unreadable ({exc})") from None


def _init_distributed(device_pref: str) -> tuple[Rank, torch.device]:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: join the group (NCCL on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_pref == "auto":
        device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    else:
        device = resolve_device(device_pref)
        if device.type == "cuda" and device.index is None:
            device = torch.device(f"cuda:{local}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world <= 1:
        return Rank(), device
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Rank(dist.get_rank(), dist.get_world_size(), owns), device


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return min_ratio + (1 - min_ratio) * shape


class _StopRequest:
    """SIGINT/SIGTERM ask to stop at the next step boundary; a second SIGINT aborts at once."""

    def __init__(self):
        self.requested = False
        self._old: dict[int, Any] = {}  # signal -> the handler it had

    def __enter__(self) -> _StopRequest:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: no handlers
            pass
        return self

    def _handle(self, signum, _frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class _Run:
    """One training process: setup, the step loop, checkpoints (rank 0 writes)."""

    def __init__(self, opts, recipe: Recipe, cls, out: Path, resume_from, rank: Rank, device, progress):
        self.opts, self.recipe, self.cls, self.out = opts, recipe, cls, out
        self.resume_from, self.rank, self.device, self.progress = resume_from, rank, device, progress

    # -- setup -------------------------------------------------------------------------------------
    def _load_target(self):

        spec = self.recipe.target
        # CPU training runs in float32 (the drafter is built in the target's dtype), so "auto"
        # there is float32 even on CPUs whose inference default is bfloat16
        dtype = "float32" if spec.dtype == "auto" and self.device.type == "cpu" else spec.dtype
        target = Target.load(None if spec.name == EMBEDDED else spec.name, dtype=dtype, device=self.device)
        actual = {"vocab_size": target.vocab_size, "hidden_size": target.hidden_size, "num_layers": target.num_layers}
        for key, value in actual.items():
            want = getattr(spec, key)
            if want and want != value:
                raise DspecError(
                    f"recipe {self.recipe.source}: target {spec.name!r} has {key} {value}, the recipe expects {want}"
                )
        return target

    def _build_drafter(self, target):
        seed_all(self.recipe.train.seed)  # identical initial weights on every rank
        drafter = self.cls.build(self.recipe.drafter_config(self.cls), target)
        drafter.chat_template_kwargs = dict(self.recipe.chat_template)  # recorded in its config.json
        bad = [i for i in drafter.target_layer_ids if not -1 <= i < target.num_layers]
        if bad:
            raise DspecError(
                f"recipe {self.recipe.source}: drafter.target_layer_ids {bad} are outside [-1, {target.num_layers}) "
                f"for target {self.recipe.target.name!r}"
            )
        if self.opts.init_from is not None:
            _load_initial_weights(drafter, Path(self.opts.init_from), target)
        drafter.net.to(self.device).train()
        if not drafter.trainable_parameters():
            raise DspecError(f"drafter {self.cls.name!r} has no trainable parameters")
        return drafter

    def _load_data(self, target) -> TrainData:
        spec = self.recipe.data
        ctx = target.max_context or spec.max_length
        length = min(spec.max_length, ctx)
        data = load_train_data(spec.paths, target.tokenizer, length, spec.min_loss_tokens, spec.limit,
                               self.recipe.chat_template)
        if self.rank.main:  # data regenerated under other kwargs than the recipe renders it with
            for recorded, n in data.recorded_kwargs.items():
                warn_if_other(f"{n} of {data.conversations} training conversation(s) ({', '.join(spec.paths)}) were "
                              "regenerated", json.loads(recorded), self.recipe.chat_template, target.tokenizer,
                              effect="the drafter learns answers the target gave under other kwargs")
        if self.rank.main and data.split:
            self.progress.note(f"{data.split} conversation(s) became one sample per assistant turn (the chat "
                               "template rewrites earlier turns)")
        if self.rank.main and data.skipped:
            self.progress.note(f"skipped {data.skipped} sample(s) with < {spec.min_loss_tokens} assistant tokens")
        if self.rank.main and data.truncated:
            self.progress.note(f"truncated {data.truncated} sample(s) to {length} tokens (data.max_length"
                               + (" capped by the target's context" if length < spec.max_length else "") + ")")
        return data

    def _setup(self) -> int:
        """Target, drafter, data, optimizer, schedule; restores a checkpoint. Returns the start step."""
        t, rank, device = self.recipe.train, self.rank, self.device
        self.target = self._load_target()
        self.drafter = self._build_drafter(self.target)
        self.data = self._load_data(self.target)
        self.drafter.prepare_training(self.data)  # e.g. eagle3 builds its draft vocabulary from the data
        if rank.main:  # known before step 1: which engines will serve the result (dspec export)
            self.progress.note(describe(*serving_methods(self.drafter, self.target)))
        self.order = DataOrder(len(self.data), t.global_batch, t.seed)
        self.total = t.max_steps or self.order.steps_for(t.epochs)
        if t.global_batch % (t.micro_batch * rank.world):
            raise DspecError(
                f"train.global_batch {t.global_batch} must be a multiple of train.micro_batch {t.micro_batch} "
                f"x world size {rank.world}"
            )
        self.accum = t.global_batch // (t.micro_batch * rank.world)
        self.sharded = t.shard == "fsdp" and rank.world > 1
        self.loss_module = _wrap(self.drafter, device, rank.world, self.sharded)  # before the optimizer sees params
        self.params = self.drafter.trainable_parameters()
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
        total, warmup = self.total, math.ceil(t.warmup_ratio * self.total)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, total, warmup, t.schedule, t.min_lr_ratio)
        )
        cache = None
        if self.opts.feature_cache:
            meta = {"target": self.recipe.target.name, "target_weights": weights_fingerprint(self.target.model),
                    "layer_ids": list(self.drafter.target_layer_ids),
                    "hidden_size": self.target.hidden_size, "dtype": str(self.target.dtype).replace("torch.", "")}
            cache = FeatureCache(self.opts.feature_cache, meta)
        self.features = Features(self.target, self.drafter.target_layer_ids, cache)
        pad = self.target.tokenizer.pad_token_id if self.target.tokenizer is not None else None
        self.pad_id = pad if pad is not None else 0
        if self.resume_from is None:
            seed_all(t.seed + rank.rank)
            return 0
        if self.sharded:

            module = cast(torch.nn.Module, self.loss_module)  # sharded: the FSDP module
            states = sharding.load(self.resume_from, module, self.optimizer, self.scheduler)
        else:
            states = load_checkpoint(self.resume_from, self.drafter, self.optimizer, self.scheduler, device)
        start = read_state(self.resume_from)["step"]
        if len(states) == rank.world:
            restore_rng(states[rank.rank], device)
        else:
            seed_all(t.seed + 7919 * start + rank.rank)
            if rank.main:
                self.progress.note(
                    f"resuming with {rank.world} process(es) instead of {len(states)}: random streams restart, "
                    "so the run is not bitwise identical to an uninterrupted one"
                )
        return start

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        t, rank = self.recipe.train, self.rank
        step = self._setup()
        log_path = Path(self.opts.json_log) if self.opts.json_log else self.out / LOG_NAME
        if rank.main:
            ensure_folder(self.out)
            trim_log(log_path, step)
            self.progress.start(self.total, step, f"{self.cls.name} · {self.recipe.target.name}")
        rank.barrier()
        stop_at = min(self.total, self.opts.stop_after) if self.opts.stop_after else self.total
        row: dict = read_state(self.resume_from).get("metrics", {}) if self.resume_from is not None else {}
        ckpt = None

        reporters = Reporters(self.opts.report_to if rank.main else (), self.out)
        with _StopRequest() as stop, open_append(log_path if rank.main else os.devnull) as log:
            while step < stop_at:
                row, stop_requested = self._step(step, stop.requested)
                step += 1
                if rank.main:
                    self.progress.update(row)
                stopping = stop_requested or step == stop_at or (rank.world == 1 and stop.requested)
                if rank.main and (step % t.log_every == 0 or step == self.total or stopping):
                    write_line(log, row)
                    log.flush()
                    reporters.log(row)
                if (t.save_every and step % t.save_every == 0) or step == self.total or stopping:
                    ckpt = self._save(step, row)
                if stopping:
                    break
            interrupted = stop.requested
        reporters.close()
        finished = step >= self.total
        if finished:
            with self._full_state():
                if rank.main:
                    self.drafter.save_pretrained(self.out)
                    write_model_card(self.out, self._card(step, row))
        rank.barrier()
        return TrainResult(self.out, step, self.total, finished, row, ckpt, interrupted=interrupted and not finished)

    def _step(self, step: int, stop_requested: bool) -> tuple[dict, bool]:
        """One optimizer step (0-based ``step``); returns its log row and whether any rank asked to stop."""
        t, rank, device = self.recipe.train, self.rank, self.device
        amp = device.type == "cuda" and t.dtype != "float32"
        t0 = time.perf_counter()
        sums: dict[str, torch.Tensor] = {}
        tokens = torch.zeros((), device=device)
        micro = list(self.order.micro_batches(step, rank.rank, rank.world, t.micro_batch))
        for i, indices in enumerate(micro):
            batch = self.data.collate(indices, self.pad_id, device)
            feats = self.features(batch, indices)
            last = i == len(micro) - 1  # DDP all-reduces in this backward; the earlier ones accumulate locally
            with _no_sync(self.loss_module, last), torch.autocast(device.type, dtype=getattr(torch, t.dtype), enabled=amp):
                out = self.loss_module(batch, feats)
            if out["loss"].requires_grad:
                with _no_sync(self.loss_module, last):
                    (out["loss"] / self.accum).backward()
            for k, v in out.items():
                v = v.detach().float() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
                sums[k] = sums.get(k, 0.0) + v.to(device)
            tokens += batch["attention_mask"].sum()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip if t.grad_clip > 0 else float("inf"))
        if self.sharded:

            grad_norm = full_norm(grad_norm)
        keys = sorted(sums)
        extra = [tokens.float(), grad_norm.float(), torch.tensor(float(stop_requested), device=device)]
        packed = torch.stack([sums[k] / self.accum for k in keys] + extra)
        if rank.world > 1:
            dist.all_reduce(packed)
        values = packed.tolist()  # the step's one host sync
        metrics = {k: v / rank.world for k, v in zip(keys, values, strict=False)}  # values: then the extras
        if not math.isfinite(metrics["loss"]):
            raise DspecError(f"loss is {metrics['loss']} at step {step + 1}; lower train.lr or check the data")
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        n_tok, norm_sum, stops = values[len(keys):]
        row = {"step": step + 1, "epoch": self.order.epoch_at(step + 1), "lr": lr, **metrics,
               "grad_norm": norm_sum / rank.world, "tokens": int(n_tok), "tokens_per_s": n_tok / max(elapsed, 1e-9),
               "step_s": elapsed}
        return row, stops > 0

    def _save(self, step: int, row: dict) -> Path:
        states: list[Any] | None = [None] * self.rank.world if self.rank.main else None  # per-rank RNG states
        rng = capture_rng(self.device)
        if self.rank.world > 1:
            dist.gather_object(rng, states, dst=0)
        else:
            states = [rng]
        path = self.out / "checkpoints" / f"step_{step}"
        with self._full_state():
            if states is not None:  # rank 0
                state = {"drafter": self.cls.name, "target": self.recipe.target.name, "total_steps": self.total,
                         "world_size": self.rank.world, "accumulation": self.accum, "samples": len(self.data),
                         "samples_seen": step * self.recipe.train.global_batch, "metrics": row}
                path = save_checkpoint(self.out, step, self.drafter, self.optimizer, self.scheduler, state, states,
                                       self.recipe.to_dict(), self.recipe.train.keep_checkpoints)
        self.rank.barrier()
        return path

    def _full_state(self):
        """Sharded runs: the unsharded weights and optimizer state on rank 0 (collective)."""
        if not self.sharded:
            return contextlib.nullcontext()

        return gathered(cast(torch.nn.Module, self.loss_module), self.drafter, self.optimizer, self.rank.main)

    def _card(self, step: int, row: dict) -> dict:
        r, data = self.recipe, self.data
        name = r.target.name
        return {
            "drafter": self.cls.name, "target": name, "target_is_embedded": name == EMBEDDED,
            "data": {"path": r.data.path, "samples": len(data), "skipped": data.skipped, "truncated": data.truncated,
                     "tokens": data.num_tokens, "loss_tokens": data.num_loss_tokens,
                     "chat_template_kwargs": data.recorded_kwargs},
            "chat_template_kwargs": r.chat_template,
            "step": step, "total_steps": self.total, "epochs": step * r.train.global_batch / len(data),
            "global_batch": r.train.global_batch, "lr": r.train.lr, "schedule": r.train.schedule,
            "warmup_ratio": r.train.warmup_ratio, "world_size": self.rank.world,
            "init_from": str(self.opts.init_from) if self.opts.init_from is not None else None,
            "metrics": {k: v for k, v in row.items() if k not in _CARD_SKIP},
            "recipe": r.to_dict(),
        }


def _load_initial_weights(drafter, path: Path, target) -> None:
    """Fine-tuning: copy a checkpoint's weights into the freshly built drafter. The checkpoint
    (dspec's, or another project's layout: docs/interop.md) must hold the same drafter for a
    target of the same sizes and tokenizer, and its tensors must fit the recipe's architecture
    exactly."""
    weights = trained_weights(type(drafter), path, target, f"--init-from {path}")
    own = drafter.net.state_dict()
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    shapes = [k for k in set(own) & set(weights) if own[k].shape != weights[k].shape]
    if missing or unexpected or shapes:
        what = (f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}" if unexpected
                else f"{shapes[0]} is {tuple(weights[shapes[0]].shape)}, the recipe builds {tuple(own[shapes[0]].shape)}")
        raise DspecError(f"--init-from {path}: its weights do not fit the recipe's {drafter.name} drafter ({what})")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(weights[k])


class _Loss(torch.nn.Module):
    """``drafter.training_loss`` as a module's forward (what DistributedDataParallel wraps)."""

    def __init__(self, drafter: TrainableDrafter):
        super().__init__()
        self.net = drafter.net  # registered: DDP finds the parameters here
        self._drafter = [drafter]  # not a submodule

    def forward(self, batch: dict, feats) -> dict:
        out = self._drafter[0].training_loss(batch, feats)
        if not out["loss"].requires_grad:  # nothing to learn in this batch: a zero that still touches every
            touch = sum(p.sum() for p in self.net.parameters() if p.requires_grad)  # parameter, so this rank
            out = {**out, "loss": out["loss"] + 0.0 * touch}  # joins the other ranks' gradient all-reduce
        return out


def _wrap(drafter: TrainableDrafter, device: torch.device, world: int, sharded: bool):
    """The loss module: plain in one process; across several, DistributedDataParallel, or FSDP2
    (``sharded``: see :mod:`dspec_cli.training.sharding`)."""
    if world <= 1:
        return drafter.training_loss
    if sharded:

        return shard(_Loss(drafter))
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" and device.index is not None else None
    return DistributedDataParallel(_Loss(drafter), device_ids=ids, find_unused_parameters=True)


@contextlib.contextmanager
def _no_sync(module, sync: bool):
    """No gradient reduction in this forward/backward unless ``sync`` (DDP ``no_sync``; FSDP2
    ``set_requires_gradient_sync``); nothing to do in one process."""
    no_sync = getattr(module, "no_sync", None)  # DDP
    if sync or not isinstance(module, torch.nn.Module):
        yield
    elif no_sync is not None:
        with no_sync():
            yield
    else:
        fsdp = cast(Any, module)  # FSDP2's FSDPModule
        fsdp.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            fsdp.set_requires_gradient_sync(True)

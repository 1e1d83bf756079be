"""Wall-time-budgeted pre-training of the tiny Qwen3 target / draft on the domain mix (CPU)."""

import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from corpus import DOMAINS, SPECIALS
from models import make_config
from tokenizers import Tokenizer
from transformers import Qwen3ForCausalLM

# Share of training sequences per (domain, kind): 60% raw text, 40% ChatML conversations.
WEIGHTS = {("code", "raw"): .18, ("prose", "raw"): .19, ("docs", "raw"): .17, ("math", "raw"): .04,
           ("code", "chat"): .11, ("prose", "chat"): .09, ("docs", "chat"): .08, ("math", "chat"): .14}
HPARAMS = {  # batch x seq = 4096 tokens/step for both sizes
    "target": dict(lr=2e-3, min_lr=2e-4, warmup=50, batch=8, seq=512),
    "draft": dict(lr=3e-3, min_lr=3e-4, warmup=50, batch=8, seq=512),
}
CONTINUE_LR_FACTOR = 0.5  # a continued phase re-warms to half the peak learning rate
PHASE_KEYS = ("step", "tokens", "train_s", "wall_s", "tok_per_s", "hparams", "minutes", "max_steps", "bf16")
EVAL_WINDOWS = 12
EVAL_EVERY_MIN = 2.5
CKPT_AT_MIN = (5, 15)


def load_streams(data_dir: Path, split: str) -> dict[tuple[str, str], np.ndarray]:
    """uint16 token arrays per (domain, kind) for `split` ('train' or 'val')."""
    out = {}
    for domain, kind in WEIGHTS:
        path = data_dir / f"{domain}.{kind}.{split}.npy"
        if not path.exists():
            raise ValueError(f"data_dir: missing {path.name}; run the tokenizer stage first")
        out[(domain, kind)] = np.load(path, mmap_mode="r")
    return out


def eval_windows(val: dict, seq: int, n: int) -> dict[tuple[str, str], torch.Tensor]:
    """Up to n evenly spaced, non-overlapping windows of seq+1 tokens per stream."""
    out = {}
    for key, arr in val.items():
        k = min(n, (len(arr) - 1) // (seq + 1))
        if k < 1:
            raise ValueError(f"val stream {key} has fewer than {seq + 1} tokens")
        starts = np.linspace(0, len(arr) - seq - 1, k).astype(np.int64)
        out[key] = torch.from_numpy(np.stack([arr[s:s + seq + 1] for s in starts]).astype(np.int64))
    return out


@torch.no_grad()
def evaluate(model, windows: dict, bf16: bool, batch: int = 8) -> dict:
    """Mean loss (nats/token) and top-1 accuracy per stream, per domain and overall."""
    model.eval()
    res = {}
    for (domain, kind), x in windows.items():  # x: [N, T+1]
        nll, hit, n = 0.0, 0, 0
        for i in range(0, len(x), batch):
            xb = x[i:i + batch]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(input_ids=xb[:, :-1]).logits  # [B, T, V]
            logits, y = logits.float().flatten(0, 1), xb[:, 1:].flatten()
            nll += F.cross_entropy(logits, y, reduction="sum").item()
            hit += (logits.argmax(-1) == y).sum().item()
            n += y.numel()
        res[f"{domain}.{kind}"] = {"loss": nll / n, "top1": hit / n, "tokens": n}
    for domain in DOMAINS:
        parts = [res[f"{domain}.{k}"] for k in ("raw", "chat")]
        n = sum(p["tokens"] for p in parts)
        res[domain] = {m: sum(p[m] * p["tokens"] for p in parts) / n for m in ("loss", "top1")}
    res["mean"] = {m: sum(res[d][m] for d in DOMAINS) / len(DOMAINS) for m in ("loss", "top1")}
    model.train()
    return res


class Sampler:
    """Random windows of seq+1 tokens; the stream of each row is drawn by WEIGHTS."""

    def __init__(self, train: dict, batch: int, seq: int, seed: int):
        self.keys = list(WEIGHTS)
        self.arrays = [train[k] for k in self.keys]
        self.p = np.array([WEIGHTS[k] for k in self.keys]) / sum(WEIGHTS.values())
        self.batch, self.seq = batch, seq
        self.rng = np.random.default_rng(seed)

    def __call__(self) -> torch.Tensor:  # [B, T+1]
        rows = []
        for s in self.rng.choice(len(self.keys), size=self.batch, p=self.p):
            arr = self.arrays[s]
            start = self.rng.integers(0, len(arr) - self.seq - 1)
            rows.append(np.asarray(arr[start:start + self.seq + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))


def _lr(step: int, progress: float, hp: dict) -> float:
    if step < hp["warmup"]:
        return hp["lr"] * (step + 1) / hp["warmup"]
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return hp["min_lr"] + (hp["lr"] - hp["min_lr"]) * cos


def save_checkpoint(model, path: Path, state: dict) -> None:
    """Atomic: write to a temp dir, then rename over `path`."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    (tmp / "train_state.json").write_text(json.dumps(state, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def build_model(size: str, tokenizer_file: Path, seed: int) -> Qwen3ForCausalLM:
    tok = Tokenizer.from_file(str(tokenizer_file))
    special = {s: tok.token_to_id(s) for s in SPECIALS}
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(make_config(size, tok.get_vocab_size(), special))


def train(size: str, out_dir: Path, data_dir: Path, tokenizer_file: Path, minutes: float,
          max_steps: int | None = None, seed: int = 0, bf16: bool = True,
          init_from: Path | None = None) -> dict:
    """Train for `minutes` of training time (evaluation excluded) or `max_steps` steps.

    With `init_from` (a checkpoint written by this function) training continues from its
    weights with a fresh optimizer and a new warmup + cosine schedule at CONTINUE_LR_FACTOR
    times the learning rates; the earlier phases are kept in the state.
    """
    if minutes <= 0:
        raise ValueError(f"minutes must be > 0, got {minutes}")
    torch.set_num_threads(2)
    hp, phases = HPARAMS[size], []
    out_dir.mkdir(parents=True, exist_ok=True)
    if init_from is None:
        model = build_model(size, tokenizer_file, seed)
    else:
        model = Qwen3ForCausalLM.from_pretrained(init_from, dtype=torch.float32)
        prev = json.loads((init_from / "train_state.json").read_text())
        phases = prev.get("phases", []) + [{k: prev.get(k) for k in PHASE_KEYS}]
        hp = dict(hp, lr=hp["lr"] * CONTINUE_LR_FACTOR, min_lr=hp["min_lr"] * CONTINUE_LR_FACTOR)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=hp["lr"], betas=(0.9, 0.95))
    sample = Sampler(load_streams(data_dir, "train"), hp["batch"], hp["seq"], seed + len(phases))
    windows = eval_windows(load_streams(data_dir, "val"), hp["seq"], EVAL_WINDOWS)
    log = (out_dir / "log.jsonl").open("a")
    budget, step, tokens, train_s = minutes * 60, 0, 0, 0.0
    wall0, next_eval, ckpts = time.time(), 0.0, list(CKPT_AT_MIN)

    def record(extra: dict) -> dict:
        rec = {"step": step, "tokens": tokens, "train_min": round(train_s / 60, 3),
               "wall_min": round((time.time() - wall0) / 60, 3), **extra}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        return rec

    record({"event": "start", "size": size, "params": n_params, "hparams": hp, "bf16": bf16,
            "init_from": str(init_from) if init_from else None})
    while train_s < budget and (max_steps is None or step < max_steps):
        if train_s >= next_eval:
            ev = evaluate(model, windows, bf16)
            record({"event": "eval", "eval": ev})
            print(f"[{size}] step {step} tok {tokens / 1e6:.2f}M train {train_s / 60:.1f}min "
                  f"val " + " ".join(f"{d} {ev[d]['loss']:.2f}/{ev[d]['top1']:.2f}"
                                     for d in (*DOMAINS, "mean")), flush=True)
            next_eval += EVAL_EVERY_MIN * 60
        if ckpts and train_s >= ckpts[0] * 60:
            save_checkpoint(model, out_dir / f"ckpt_{ckpts.pop(0)}min",
                            {"step": step, "tokens": tokens, "train_s": train_s})
        t0 = time.time()
        progress = max(train_s / budget, step / max_steps if max_steps else 0.0)
        for g in opt.param_groups:
            g["lr"] = _lr(step, progress, hp)
        x = sample()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x[:, :-1]).logits  # [B, T, V]
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, tokens = step + 1, tokens + x[:, 1:].numel()
        train_s += time.time() - t0
        if step % 50 == 0:
            record({"event": "train", "loss": loss.item(), "grad_norm": gnorm.item(),
                    "lr": opt.param_groups[0]["lr"], "tok_per_s": round(tokens / train_s)})
    ev = evaluate(model, windows, bf16)
    state = {"size": size, "params": n_params, "step": step, "tokens": tokens,
             "train_s": round(train_s, 1), "wall_s": round(time.time() - wall0, 1),
             "tok_per_s": round(tokens / max(train_s, 1e-9)), "seed": seed, "bf16": bf16,
             "minutes": minutes, "max_steps": max_steps,
             "hparams": hp, "weights": {f"{d}.{k}": w for (d, k), w in WEIGHTS.items()},
             "eval": ev, "phases": phases}
    for key in ("tokens", "train_s", "wall_s"):
        state[f"total_{key}"] = state[key] + sum(p[key] for p in phases)
    record({"event": "end", **state})
    save_checkpoint(model, out_dir / "final", state)
    print(f"[{size}] done: {step} steps, {tokens / 1e6:.2f}M tokens, train {train_s / 60:.1f} "
          f"min, wall {(time.time() - wall0) / 60:.1f} min, mean val loss {ev['mean']['loss']:.3f}",
          flush=True)
    return state

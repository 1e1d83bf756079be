"""Export a trained checkpoint as a bf16 Hugging Face model dir with tokenizer, chat template,
generation config and a model card (measured validation metrics and sampled outputs)."""

import json
import shutil
import time
from pathlib import Path

import chatgen
import torch
import train
from corpus import DOMAINS
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
FINAL_EVAL_WINDOWS = 64
# Own prompts for the card (never taken from the benchmark files).
SAMPLE_PROMPTS = {
    "math": "Lina buys 3 books for $12 each and pays with a $50 bill. How much change does "
            "she get?\nPlease reason step by step, and put your final answer within \\boxed{}.",
    "code": "Write a solution to the following problem and make sure that it passes the tests:\n"
            "```python\n\n\ndef count_vowels(text: str) -> int:\n    \"\"\" Return the number of "
            "vowels in text.\n    >>> count_vowels('hello')\n    2\n    \"\"\"\n\n```",
    "docs": "What is a generator in Python?",
    "chat": "Write a short story about a rainy afternoon in the countryside.",
}
SOURCES_TABLE = """| domain | source (Debian package / interpreter) | license |
|---|---|---|
| code | CPython 3.11 standard library `*.py` (no tests, encodings, site-packages) | PSF-2.0 |
| prose | Jane Austen's six novels (`r-cran-janeaustenr`) | text public domain; package MIT |
| prose | King James Bible (`bible-kjv-text`) | text public domain (Crown patent in the UK); packaging GPL-2+ |
| prose | `fortunes` cookies | BSD package; quotations of mixed provenance |
| docs | Python 3.11 manual (`python3.11-doc` info), `pydoc_data.topics` | PSF docs license |
| docs | Jargon File (`jargon-text`) | public domain |
| docs | Debian Reference / Debian FAQ / GNU coding standards + maintainers guide | GPL-2+ / GPL-ish / GFDL-1.3 |
| math | own synthetic GSM8K-style generator (`recipes/tiny/mathgen.py`) | CC0 |"""


def _tokenizer(tokenizer_file: Path) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file), bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>"], model_max_length=2048)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def check_template(tok) -> None:
    """The shipped chat template must render exactly like the training conversations."""
    conv = [{"role": "system", "content": chatgen.SYSTEM}, {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."}]
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    if text != chatgen.render(conv) + "<|im_start|>assistant\n":
        raise ValueError(f"chat template renders {text!r}, not the training format")
    ids = tok(text).input_ids
    if ids[0] != tok.convert_tokens_to_ids("<|im_start|>") or tok.eos_token != "<|im_end|>":
        raise ValueError("tokenizer does not map the ChatML special tokens")


def _samples(model, tok, seed: int, max_new_tokens: int = 160) -> dict:
    """T=0.8 samples and one greedy sample per prompt, plus plain decode speed."""
    out = {}
    for name, prompt in SAMPLE_PROMPTS.items():
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, return_tensors="pt").input_ids
        torch.manual_seed(seed)
        t = time.time()
        gen = model.generate(ids, do_sample=True, temperature=0.8, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens)
        dt = time.time() - t
        greedy = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        n_new = gen.shape[1] - ids.shape[1]
        out[name] = {"prompt": prompt,
                     "sample_t0.8": tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False),
                     "greedy": tok.decode(greedy[0, ids.shape[1]:], skip_special_tokens=False),
                     "new_tokens": n_new, "tok_per_s": round(n_new / dt, 1)}
    return out


def _table(ev: dict) -> str:
    rows = ["| domain | val loss (nats/token) | top-1 | raw loss / top-1 | chat loss / top-1 |",
            "|---|---|---|---|---|"]
    for d in DOMAINS:
        r, c = ev[f"{d}.raw"], ev[f"{d}.chat"]
        rows.append(f"| {d} | {ev[d]['loss']:.3f} | {ev[d]['top1']:.3f} | "
                    f"{r['loss']:.3f} / {r['top1']:.3f} | {c['loss']:.3f} / {c['top1']:.3f} |")
    rows.append(f"| mean | {ev['mean']['loss']:.3f} | {ev['mean']['top1']:.3f} | | |")
    return "\n".join(rows)


def _command(size: str, state: dict, phases: list[dict]) -> str:
    """The build.py stage commands that trained these weights, one per phase (seed, budget,
    step limit); later phases continue from the earlier weights."""
    minutes, steps = ("--minutes", "--max-steps") if size == "target" else ("--draft-minutes", "--draft-max-steps")
    cmds = []
    for i, phase in enumerate(phases):
        cmd = f"python recipes/tiny/build.py --stage {size} --seed {state['seed']}"
        if phase.get("minutes"):
            cmd += f" {minutes} {phase['minutes']:g}"
        if phase.get("max_steps"):
            cmd += f" {steps} {phase['max_steps']}"
        if phase.get("bf16") is False:
            cmd += " --fp32"
        cmds.append(cmd + (" --continue" if i else ""))
    return "` then `".join(cmds)


def _card(size: str, cfg, state: dict, ev: dict, samples: dict, n_params: int, size_mb: float,
          data_stats: dict) -> str:
    train_tokens = sum(v["tokens"] for k, v in data_stats.items() if k.endswith(".train"))
    phases = state.get("phases", []) + [{k: state.get(k) for k in train.PHASE_KEYS}]
    total_tokens = sum(p["tokens"] for p in phases)
    shares = ", ".join(f"{k} {w:.2f}" for k, w in state["weights"].items())
    name = "tiny-target" if size == "target" else "tiny-draft-model"
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation",
        "tags: [dspec, qwen3, speculative-decoding, cpu]", "---", "",
        f"# dspec {name}", "",
        ("The embedded default target of dspec: a Qwen3-architecture chat model trained from "
         "scratch on CPU from text that ships with Debian and CPython. It exists so speculative "
         "decoding can be demonstrated and tested offline; it is not a useful assistant."
         if size == "target" else
         "A small Qwen3-architecture draft model for `draft-model` speculative decoding against "
         "`tiny-target` (same tokenizer, same corpus, same recipe)."), "",
        "## Model", "",
        f"- Qwen3ForCausalLM, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, FFN "
        f"{cfg.intermediate_size}, {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV "
        f"heads, head_dim {cfg.head_dim}, tied embeddings, RoPE theta 10000, SDPA attention.",
        f"- {n_params / 1e6:.2f}M parameters, vocab {cfg.vocab_size}; bf16 safetensors, folder "
        f"{size_mb:.1f} MB.",
        "- Tokenizer: byte-level BPE, 8192 entries, special tokens `<|endoftext|>` (0, bos/pad), "
        "`<|im_start|>` (1), `<|im_end|>` (2, eos), `<|mask|>` (3, reserved for parallel "
        "drafters, never seen in training).",
        "- Chat template: ChatML (`<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`), "
        "no default system prompt. Generation stops at `<|im_end|>` or `<|endoftext|>`.", "",
        "## Training", "",
        f"- Recipe: `{_command(size, state, phases)}`; see recipes/tiny/README.md.",
        f"- {total_tokens / 1e6:.2f}M tokens seen in windows of {state['hparams']['seq']} tokens, "
        f"{state['hparams']['batch']} per step (corpus: {train_tokens / 1e6:.1f}M training tokens, "
        f"so {total_tokens / train_tokens:.2f} epochs).",
        f"- {state.get('total_train_s', state['train_s']) / 60:.1f} min of training time; "
        f"measured wall time {state.get('total_wall_s', state['wall_s']) / 60:.1f} min including "
        f"evaluation, on 2 CPU cores shared with other jobs (bf16 autocast: {', then '.join(str(p.get('bf16')) for p in phases)}).",
        *[f"- Phase {i + 1}: {p['step']} steps, {p['tokens'] / 1e6:.2f}M tokens, "
          f"{p['train_s'] / 60:.1f} min training / {p['wall_s'] / 60:.1f} min wall, "
          f"{p['tok_per_s']} tokens/s, AdamW lr {p['hparams']['lr']:g} -> {p['hparams']['min_lr']:g}"
          for i, p in enumerate(phases)],
        f"- AdamW betas (0.9, 0.95), wd 0.1 (matrices only), {state['hparams']['warmup']} warmup "
        "steps, cosine decay over each phase's step count (`--max-steps`) or time budget, whichever "
        "ends first, clip 1.0. A continued phase "
        "(`build.py --continue`) restarts the schedule from the previous weights.",
        f"- Sampling shares (domain.kind): {shares}. `chat` streams are synthetic ChatML "
        "conversations: math word problems with step-by-step answers (half of the instructed ones told as a story: pronouns, an unrelated Austen sentence), Python functions from "
        "their signature/docstring, documentation Q&A, story continuations, Bible and fortune "
        "requests.", "",
        "## Validation (held-out every 50th 32 KB chunk, exported bf16 weights)", "",
        _table(ev), "",
        "Loss is in nats per token; top-1 is teacher-forced next-token accuracy. Predictability "
        "differs by domain by design: the templated math is easy, English prose is hard. "
        "Chat-code validation functions can also occur inside the raw stdlib training files.", "",
        "## Corpus and licenses", "", SOURCES_TABLE, "",
        "The weights are a statistical product of all of the above. The GPL/GFDL documentation "
        "(Debian Reference, Debian FAQ, GNU standards, about 1.6 MB) and the fortunes (2.4 MB) "
        "are a small share; recipes/tiny/README.md says how to build a permissive-only variant.",
        "",
        "## Samples (chat template applied, T = 0.8, seed fixed; then greedy)", "",
    ]
    for name, s in samples.items():
        lines += [f"### {name}", "", "Prompt:", "", "```", s["prompt"], "```", "",
                  f"Sample (T=0.8, {s['new_tokens']} tokens, {s['tok_per_s']} tok/s plain "
                  "`generate`):", "", "```", s["sample_t0.8"], "```", "", "Greedy:", "", "```",
                  s["greedy"], "```", ""]
    lines += ["Greedy decoding of a model this small falls into repetition loops; benchmark at "
              "T = 1 as well.", ""]
    return "\n".join(lines)


def export(size: str, run_dir: Path, data_dir: Path, tokenizer_file: Path, dest: Path,
           seed: int = 0) -> dict:
    """Write `dest` (bf16 weights, tokenizer, generation config, README.md); return metrics."""
    torch.set_num_threads(2)
    final = run_dir / "final"
    state = json.loads((final / "train_state.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    tok = _tokenizer(tokenizer_file)
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config = GenerationConfig(
        bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot, max_new_tokens=256)
    shutil.rmtree(dest, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(dest)
    tok.save_pretrained(dest)
    (dest / "train_state.json").write_text(json.dumps(state, indent=1))  # provenance; --init-from
    # Reload exactly what ships and measure it.
    model = AutoModelForCausalLM.from_pretrained(dest)
    tok = AutoTokenizer.from_pretrained(dest)
    check_template(tok)
    model.eval()
    windows = train.eval_windows(train.load_streams(data_dir, "val"), state["hparams"]["seq"],
                                 FINAL_EVAL_WINDOWS)
    ev = train.evaluate(model, windows, bf16=False)
    samples = _samples(model, tok, seed)
    n_params = sum(p.numel() for p in model.parameters())
    size_mb = sum(f.stat().st_size for f in dest.iterdir()) / 1e6
    data_stats = json.loads((data_dir / "stats.json").read_text())
    (dest / "README.md").write_text(
        _card(size, model.config, state, ev, samples, n_params, size_mb, data_stats),
        encoding="utf-8")
    metrics = {"state": state, "eval": ev, "samples": samples, "size_mb": size_mb}
    (run_dir / "export_metrics.json").write_text(json.dumps(metrics, indent=1))
    return metrics

"""Tiny random causal LMs and an offline ChatML tokenizer for tests (nothing is downloaded).

Models are fp32, seeded, with ``attn_implementation="sdpa"``. Weights use a large
``initializer_range`` so that masking mistakes change the logits far beyond test tolerances.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    Gemma4TextConfig,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

from dspec_cli.core.sampling import logits_to_probs

VOCAB_SIZE = 384
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.
Speculative decoding drafts several tokens with a small model and verifies them with a large one.
A target model scores every drafted token in one forward pass; accepted tokens are kept.
Rejected drafts are discarded and the target samples a correction from the residual distribution.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 and 2024 appear in text, as do symbols: + - * / = ( ) [ ] { }.
def add(a, b):
    return a + b
User: What is the capital of France? Assistant: The capital of France is Paris.
User: Write a short poem about the sea. Assistant: Waves roll in, waves roll out, the gulls cry.
Lossless verification keeps the output distribution exactly equal to the target's own sampling.
"""


@lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True) * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (≤ ``VOCAB_SIZE`` ids) trained in memory, with a ChatML chat template."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def _special_ids() -> dict:
    tok = Tokenizer.from_str(_trained_tokenizer_json())
    return {
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "pad_token_id": tok.token_to_id("<|endoftext|>"),
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
    }


_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.2,
)


def _build(config, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


def tiny_qwen3(seed: int = 0) -> PreTrainedModel:
    """Qwen3ForCausalLM: 3 layers, d=64, GQA 4/2 heads, q/k norms, tied embeddings."""
    return _build(Qwen3Config(**_COMMON, tie_word_embeddings=True, **_special_ids()), seed)


def tiny_llama(seed: int = 0) -> PreTrainedModel:
    """LlamaForCausalLM: 3 layers, d=64, GQA 4/2 heads, untied head."""
    return _build(LlamaConfig(**_COMMON, tie_word_embeddings=False, **_special_ids()), seed)


def tiny_gemma3(seed: int = 0, sliding_window: int = 6) -> PreTrainedModel:
    """Gemma3ForCausalLM (text): sliding/full/sliding layers with a short window, scaled embeddings,
    untied head."""
    config = Gemma3TextConfig(
        **_COMMON,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=16,
        tie_word_embeddings=False,  # tied + scaled embeddings make tiny random Gemmas repeat the last token
        **_special_ids(),
    )
    return _build(config, seed)


def tiny_gemma4(seed: int = 0, sliding_window: int = 6, k_eq_v: bool = True) -> PreTrainedModel:
    """Gemma4ForCausalLM (text): sliding/full/full layers; full layers with a global head dim 32
    (sliding 16), proportional RoPE and, with ``k_eq_v``, one global KV head whose V reuses the K
    projection; scaled embeddings, final-logit softcap 30, untied head, no per-layer inputs / MoE."""
    config = Gemma4TextConfig(
        **_COMMON,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=k_eq_v,
        hidden_size_per_layer_input=0,
        final_logit_softcapping=30.0,
        tie_word_embeddings=False,
        **_special_ids(),
    )
    return _build(config, seed)


FACTORIES = {"qwen3": tiny_qwen3, "llama": tiny_llama, "gemma3": tiny_gemma3, "gemma4": tiny_gemma4}


def tiny_target(family: str = "qwen3", seed: int = 0):
    """A ``dspec_cli.runtime.target.Target`` around a tiny model of ``family`` with the ChatML tokenizer."""
    from dspec_cli.runtime.target import Target

    return Target(FACTORIES[family](seed), tiny_tokenizer())


TRAIN_TEXTS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "Speculative decoding drafts several tokens with a small model and verifies them.",
]


@torch.no_grad()
def full_forward(target, ids: torch.Tensor, layer_ids=()) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain forward of ids [1, L] (no cache, the model's own masks): (logits [L, V] float, taps
    [L, n·d] of ``layer_ids``), the reference the target's cached steps are tested against."""
    ids = ids.to(target.device)
    logits = target.model(input_ids=ids, use_cache=False).logits[0].float()
    taps, _ = target.decoder_features(ids, torch.ones_like(ids), layer_ids)
    return logits, taps[0]


def training_batch(target, layer_ids) -> tuple[dict, dict]:
    """A drafter training batch from TRAIN_TEXTS: two right-padded rows, loss after the first 4
    tokens, with the target features ``training_loss`` expects."""
    tok = tiny_tokenizer()
    rows = [tok.encode(t) for t in TRAIN_TEXTS]
    L = max(map(len, rows))
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        attn[r, : len(row)] = 1
    loss_mask = attn.clone()
    loss_mask[:, :4] = 0
    taps = torch.stack([full_forward(target, ids[r : r + 1], layer_ids)[1] for r in range(len(rows))])
    with torch.no_grad():
        last = target.model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state
    return {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attn}, {"taps": taps, "last_hidden": last}


def run_cli(args, capsys) -> tuple[int, str, str]:
    """Run ``dspec ARGS`` in-process: (exit code, stdout, stderr)."""
    import pytest

    from dspec_cli.cli import main

    with pytest.raises(SystemExit) as exc:
        main(args)
        raise SystemExit(0)
    out = capsys.readouterr()
    return exc.value.code or 0, out.out, out.err


def assert_cli_error(args, capsys, match: str) -> None:
    """``dspec ARGS`` fails with exactly one stderr line containing ``match`` and no traceback."""
    code, _, err = run_cli(args, capsys)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code != 0 and len(lines) == 1 and "Traceback" not in err, err
    assert match in lines[0], lines[0]


class GreedySampler:
    """The engine's sampler interface at T = 0 (argmax drafts), for calling ``propose`` directly."""

    greedy = True

    def probs(self, logits):
        return logits_to_probs(logits, 0.0)

    def sample(self, probs, step):
        return probs.argmax(-1)

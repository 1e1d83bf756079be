"""Qwen3 configurations of the tiny target and its draft model."""

from transformers import Qwen3Config

# name -> (hidden, layers, ffn, heads, kv_heads, head_dim)
SIZES = {
    "target": (256, 6, 1024, 8, 4, 32),   # the study's "M": ~8.0M params at V=8192
    "draft": (64, 2, 256, 4, 2, 16),      # ~0.65M params, ~12x fewer than the target
}


def make_config(size: str, vocab_size: int, special: dict, max_positions: int = 2048) -> Qwen3Config:
    """Qwen3Config for `size` with tied embeddings and SDPA; `special` maps token names to ids."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    hidden, layers, ffn, heads, kv, hd = SIZES[size]
    cfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=hd, max_position_embeddings=max_positions, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=special["<|endoftext|>"], eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|endoftext|>"],
    )
    cfg._attn_implementation = "sdpa"
    return cfg

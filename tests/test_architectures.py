"""The supported target families (docs/real-model.md "Supported targets"): each loads from a folder,
decodes greedily through the engine exactly as the model's own ``generate`` does, with drafters
that read its hidden states, two requests of different lengths at once; other decoders are
refused in one line naming the tested ones."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB_SIZE, _special_ids, assert_cli_error, tiny_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.target import TESTED, Target

SIZES = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
FAMILIES = {  # name -> (model_type, config fields beyond SIZES)
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=16)),
    "llama": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64})),
    "mistral": ("mistral", dict(sliding_window=None)),
    "mistral-sliding-window": ("mistral", dict(sliding_window=6)),
    "phi3": ("phi3", dict(pad_token_id=0)),
    "gemma3": ("gemma3_text", dict(head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
                                   tie_word_embeddings=False)),
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=3, n_head=4, n_positions=256)),
    "gpt-neox": ("gpt_neox", dict(rotary_pct=0.25)),
}
PROMPTS = ["The quick brown fox jumps over the lazy dog while the cat", "def add(a, b):"]


def save(tmp_path, model_type: str, attention: str = "sdpa", **fields):
    config = AutoConfig.for_model(model_type, **{**SIZES, **_special_ids(), **fields})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    return tmp_path


def drafters(target: Target):
    """A drafter without taps, one over the target's taps (KV injection) and one autoregressive over them."""
    yield get_drafter_class("prompt-lookup").load_default(target, block_size=3)
    for name, extra in (("dflash", dict(num_layers=1, anchor_predicts=False)), ("eagle3", dict(qk_norm=False))):
        cls = get_drafter_class(name)
        torch.manual_seed(1)
        yield cls.build(cls.config_class(block_size=3, **extra), target)


@pytest.mark.parametrize("family", FAMILIES)
def test_supported_family_decodes_exactly(family, tmp_path):
    model_type, fields = FAMILIES[family]
    target = Target.load(str(save(tmp_path, model_type, **fields)), dtype="float32")
    prompts = [target.render_prompt(p) for p in PROMPTS]
    want = [target.model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    cfg = GenerationConfig(max_new_tokens=16, temperature=0.0, block_size=3, max_batch=2)
    for drafter in drafters(target):
        got = [r.output_ids for r in SpeculativeEngine(target, drafter, cfg, stop_ids=[]).generate(prompts)]
        assert got == want, f"{family} with {drafter.name}"


@pytest.mark.parametrize("model_type, fields, message", [
    ("bloom", dict(n_layer=2, n_head=4, attention="eager"), "BloomForCausalLM does not support an attention implementation"),
    ("falcon", dict(alibi=True, new_decoder_architecture=False, num_kv_heads=4),
     "its positions come from the attention mask (ALiBi)"),
], ids=["no-sdpa", "alibi"])
def test_other_decoders_are_refused_in_one_line(model_type, fields, message, tmp_path, capsys):
    folder = save(tmp_path, model_type, **fields)
    capsys.readouterr()
    assert_cli_error(["bench", "--target", str(folder), "--drafter", "prompt-lookup", "--num-prompts", "1"], capsys,
                     message)
    assert_cli_error(["bench", "--target", str(folder), "--drafter", "prompt-lookup", "--num-prompts", "1"], capsys,
                     f"(tested: {TESTED})")

"""What an export's config.json says about the draft's attention: every field the drafter copies
from its target survives in every layout, RoPE scaling in every spelling the engines read
(``rope_parameters``; ``rope_theta`` + ``rope_scaling``), and the export loads back to the same
proposals, on targets with llama3- and YaRN-scaled RoPE."""

from __future__ import annotations

import json

import pytest
import torch
from test_interop import build, proposal
from tiny_models import _special_ids, tiny_tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from dspec_cli.checkpoints.layouts import ARCH_FIELDS, arch_values
from dspec_cli.checkpoints.layouts import write as export_layout
from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.runtime.target import Target

# attention fields away from every default: head_dim != hidden / heads, one KV head, eps, bias
ATTENTION = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                 rms_norm_eps=1e-5, max_position_embeddings=1024, attention_bias=True, vocab_size=384,
                 num_hidden_layers=3, initializer_range=0.2, **_special_ids())
ROPE = {
    "llama3": (LlamaConfig, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    "yarn": (Qwen3Config, {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "beta_fast": 32.0,
                           "beta_slow": 1.0, "original_max_position_embeddings": 256}),
}
LAYOUTS = [("dflash", dict(anchor_predicts=False), Qwen3Config), ("dspark-markov", dict(markov_rank=16), Qwen3Config),
           ("eagle3", dict(qk_norm=False), LlamaConfig)]
COPIED = ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
          "attention_bias", "hidden_size")  # what the draft's attention takes from the target


@pytest.fixture(scope="module", params=sorted(ROPE))
def target(request) -> Target:
    cls, rope = ROPE[request.param]
    torch.manual_seed(0)
    config = cls(**ATTENTION, rope_parameters=dict(rope), tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    return Target(model, tiny_tokenizer())


@pytest.mark.parametrize("name, overrides, reader", LAYOUTS, ids=[n for n, _, _ in LAYOUTS])
def test_attention_fields_and_rope_survive_export(target, tmp_path, name, overrides, reader):
    drafter = build(name, target, **overrides)
    cfg = drafter.config
    rope = {k: v for k, v in target.config.rope_parameters.items() if v is not None}
    assert {k: v for k, v in cfg.rope_parameters.items() if v is not None} == rope
    for key in COPIED:
        assert getattr(cfg, key) == getattr(target.config, key), key
    export_layout(drafter, target, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ARCH_FIELDS:
        assert config[key] == getattr(cfg, key), key
    # transformers 5 / vLLM: rope_parameters; transformers 4 / SGLang: rope_theta + rope_scaling
    assert config["rope_parameters"] == cfg.rope_parameters
    scaling = dict(config["rope_scaling"])
    assert scaling.pop("rope_type") == rope["rope_type"]
    assert {**scaling, "rope_theta": config["rope_theta"], "rope_type": rope["rope_type"]} == rope
    assert arch_values({k: v for k, v in config.items() if k != "rope_parameters"})["rope_parameters"] == rope
    parsed = reader.from_dict(config)  # the engines' config class reads the same attention
    assert {k: v for k, v in parsed.rope_parameters.items() if v is not None} == rope
    for key in COPIED:
        assert getattr(parsed, key) == getattr(cfg, key), key
    back = get_drafter_class(name).from_pretrained(tmp_path, target)
    assert back.config.rope_parameters == cfg.rope_parameters
    for a, b in zip(proposal(target, drafter), proposal(target, back), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_plain_rope_writes_a_null_rope_scaling(tmp_path):
    from tiny_models import tiny_target

    target = tiny_target("qwen3")
    export_layout(build("dflash", target, anchor_predicts=False), target, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_scaling"] is None and config["rope_parameters"]["rope_type"] == "default"
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]

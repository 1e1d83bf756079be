"""``dspec export``: the folder each engine reads loads back through the interop loaders with
identical proposals, the printed serve command carries the right fields, refusals are one line."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from test_interop import GAMMA, build, proposal
from tiny_models import assert_cli_error, run_cli

from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.runtime.target import Target

VARIANTS = {  # name -> (drafter, overrides, layout, vLLM method, SGLang algorithm, SGLang flags)
    "dspark": ("dspark-markov", dict(markov_rank=16), "Qwen3DSparkModel", "dspark", "DSPARK",
               ["--speculative-dspark-block-size", str(GAMMA)]),  # no calibration / cost table: no side files
    "zlab-dflash": ("dflash", dict(anchor_predicts=False), "DFlashDraftModel", "dflash", "DFLASH",
                    ["--speculative-num-draft-tokens", str(GAMMA + 1)]),
    "eagle3": ("eagle3", dict(qk_norm=False), "LlamaForCausalLMEagle3", "eagle3", "EAGLE3",
               ["--speculative-num-steps", str(GAMMA), "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", str(GAMMA + 1)]),
}


@pytest.fixture(scope="module")
def target(model_dir) -> Target:
    return Target.load(str(model_dir))


def saved(target: Target, folder, name: str, **overrides):
    build(name, target, **overrides).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_export_round_trip(target, model_dir, tmp_path, capsys, variant, fmt):
    name, overrides, layout, method, algorithm, flags = VARIANTS[variant]
    ckpt, out = saved(target, tmp_path / "ckpt", name, **overrides), tmp_path / "out"
    code, stdout, _ = run_cli(["export", str(ckpt), "--format", fmt, "--output", str(out), "--target", str(model_dir),
                               "--json", str(tmp_path / "report.json")], capsys)
    assert code == 0
    argv = shlex.split(stdout.strip())
    model, tgt = str(out.resolve()), str(model_dir.resolve())
    template = ["--default-chat-template-kwargs", '{"enable_thinking": false}']  # the mode it was trained in
    if fmt == "vllm":
        assert argv[:3] == ["vllm", "serve", tgt] and argv[3] == "--speculative-config" and argv[5:] == template
        adaptive = {"enable_adaptive_verification": True} if method == "dspark" else {}
        assert json.loads(argv[4]) == {"method": method, "model": model, "num_speculative_tokens": GAMMA, **adaptive}
    else:
        if algorithm == "DSPARK":  # confidence-scheduled verification
            assert argv.pop(0) == "SGLANG_RAGGED_VERIFY_MODE=compact"
        assert argv[:3] == ["python", "-m", "sglang.launch_server"]
        assert argv[3:] == ["--model-path", tgt, "--speculative-algorithm", algorithm,
                            "--speculative-draft-model-path", model, *flags, *template]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["layout"] == layout and report["command"] == stdout.strip()
    assert json.loads((out / "config.json").read_text())["architectures"] == [layout]
    cls = get_drafter_class(name)
    ours, back = cls.from_pretrained(ckpt, target), cls.from_pretrained(out, target)  # interop loader
    for a, b in zip(proposal(target, ours), proposal(target, back), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_export_of_a_foreign_checkpoint(target, model_dir, tmp_path, capsys):
    """An exported (foreign) folder exports again to the same files."""
    ckpt = saved(target, tmp_path / "ckpt", "dspark-markov", markov_rank=16)
    for src, dst in ((ckpt, tmp_path / "a"), (tmp_path / "a", tmp_path / "b")):
        args = ["export", str(src), "--format", "vllm", "--output", str(dst), "--target", str(model_dir)]
        code, _, _ = run_cli(args, capsys)
        assert code == 0
    assert (tmp_path / "a" / "config.json").read_text() == (tmp_path / "b" / "config.json").read_text()
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


REFUSALS = [
    ("dflash", {}, "has no vLLM/SGLang method"),
    ("dspark-rnn", dict(markov_rank=16), "vanilla Markov head only, not 'rnn'"),  # vLLM's; SGLang serves it
    ("eagle3", {}, "LlamaForCausalLMEagle3 has no q/k norms"),
]


@pytest.mark.parametrize("name, overrides, message", REFUSALS)
def test_export_refusals(target, model_dir, tmp_path, capsys, name, overrides, message):
    ckpt = saved(target, tmp_path / "ckpt", name, **overrides)
    assert_cli_error(["export", str(ckpt), "--format", "vllm", "--output", str(tmp_path / "out"),
                      "--target", str(model_dir)], capsys, message)
    assert not (tmp_path / "out").exists()


def test_export_bad_input(target, model_dir, tmp_path, capsys):
    ckpt = saved(target, tmp_path / "ckpt", "dspark-markov", markov_rank=16)
    base = ["--target", str(model_dir)]
    assert_cli_error(["export", str(ckpt), "--format", "tgi", "--output", str(tmp_path / "o"), *base], capsys,
                     "--format must be one of vllm, sglang, speculators")
    assert_cli_error(["export", str(ckpt), "--format", "vllm", "--output", str(ckpt), *base], capsys,
                     "is CHECKPOINT")
    assert_cli_error(["export", str(tmp_path / "nowhere"), "--format", "vllm", "--output", str(tmp_path / "o"), *base],
                     capsys, "nowhere")


SPECULATORS = {  # name -> (drafter, overrides, architecture, speculators_model_type)
    "dspark-markov": ("dspark-markov", dict(markov_rank=16), "DSparkSpeculator", "dspark"),
    "dspark-rnn": ("dspark-rnn", dict(markov_rank=16), "DSparkSpeculator", "dspark"),
    "zlab-dflash": ("dflash", dict(anchor_predicts=False), "DFlashSpeculator", "dflash"),
    "deepspec-dflash": ("dflash", {}, "DFlashSpeculator", "dflash"),
    "eagle3": ("eagle3", dict(qk_norm=False), "Eagle3Speculator", "eagle3"),
    "eagle3-qk-norm": ("eagle3", {}, "Eagle3Speculator", "eagle3"),
    "eagle3-reduced": ("eagle3", dict(draft_vocab_size=64), "Eagle3Speculator", "eagle3"),
}


@pytest.mark.parametrize("variant", SPECULATORS)
def test_speculators_round_trip(target, model_dir, tmp_path, capsys, variant):
    """``--format speculators`` writes every convention explicitly and loads back (the layout hook)
    to identical proposals; speculators' own loader is checked in tests/test_engine_speculators.py."""
    name, overrides, arch, kind = SPECULATORS[variant]
    ckpt, out = saved(target, tmp_path / "ckpt", name, **overrides), tmp_path / "out"
    code, stdout, err = run_cli(["export", str(ckpt), "--format", "speculators", "--output", str(out),
                               "--target", str(model_dir)], capsys)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch] and config["speculators_model_type"] == kind
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == GAMMA
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(model_dir)
    explicit = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output") if kind == "eagle3" else \
        ("sample_from_anchor", "aux_hidden_state_layer_ids", "mask_token_id", "block_size")
    assert all(key in config for key in explicit)
    assert json.loads(shlex.split(stdout.strip())[4]) == {"model": str(out.resolve()), "num_speculative_tokens": GAMMA}
    cls = get_drafter_class(name)
    ours, back = cls.from_pretrained(ckpt, target), cls.from_pretrained(out, target)
    for a, b in zip(proposal(target, ours), proposal(target, back), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("field, value, message", [
    ("sample_from_anchor", False, "sample_from_anchor = false (the anchor as a bonus token) is not supported"),
    ("markov_head_type", "gated", "markov_head_type 'gated' is not supported"),
    ("draft_vocab_size", 64, "reduced draft vocabularies are not supported"),
])
def test_speculators_variants_dspec_does_not_compute(target, model_dir, tmp_path, capsys, field, value, message):
    ckpt, out = saved(target, tmp_path / "ckpt", "dspark-markov", markov_rank=16), tmp_path / "out"
    assert run_cli(["export", str(ckpt), "--format", "speculators", "--output", str(out), "--target",
                    str(model_dir)], capsys)[0] == 0
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, field: value}))
    assert_cli_error(["bench", "--drafter", "dspark-markov", "--checkpoint", str(out), "--target", str(model_dir),
                      "--num-prompts", "1", "--max-new-tokens", "4"], capsys, message)


@pytest.mark.parametrize("fmt, field, value, message", [
    ("vllm", "norm_before_residual", True, "norm_before_residual = true is not supported"),
    ("speculators", "norm_output", True, "norm_output = true is not supported"),
])
def test_eagle3_variants_dspec_does_not_compute(target, model_dir, tmp_path, capsys, fmt, field, value, message):
    ckpt, out = saved(target, tmp_path / "ckpt", "eagle3", qk_norm=False), tmp_path / "out"
    assert run_cli(["export", str(ckpt), "--format", fmt, "--output", str(out), "--target", str(model_dir)],
                   capsys)[0] == 0
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, field: value}))
    assert_cli_error(["bench", "--drafter", "eagle3", "--checkpoint", str(out), "--target", str(model_dir),
                      "--num-prompts", "1", "--max-new-tokens", "4"], capsys, message)


@pytest.mark.parametrize("draft_vocab", [0, 100])
def test_eagle3_vocabulary_maps_only_with_a_reduced_vocabulary(target, model_dir, tmp_path, capsys, draft_vocab):
    """vLLM's EAGLE-3 has no ``d2t`` parameter with the full vocabulary and refuses one: the maps
    are written only for a reduced draft vocabulary (as SpecForge and SGLang read them)."""
    from safetensors import safe_open

    ckpt = saved(target, tmp_path / "ckpt", "eagle3", qk_norm=False, draft_vocab_size=draft_vocab)
    out = tmp_path / "out"
    assert run_cli(["export", str(ckpt), "--format", "vllm", "--output", str(out), "--target", str(model_dir)],
                   capsys)[0] == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        maps = {"d2t", "t2d"} & set(f.keys())
    assert maps == (set() if draft_vocab == 0 else {"d2t", "t2d"})
    back = get_drafter_class("eagle3").from_pretrained(out, target)
    assert torch.equal(proposal(target, back)[0], proposal(target, get_drafter_class("eagle3").from_pretrained(ckpt, target))[0])


def test_fine_tuning_starts_from_a_speculators_checkpoint(target, model_dir, tmp_path, capsys):
    """``dspec train --init-from`` takes a speculators-format folder: its weights, converted."""
    from dspec_cli.training.loop import _load_initial_weights

    ckpt, out = saved(target, tmp_path / "ckpt", "dspark-markov", markov_rank=16), tmp_path / "out"
    assert run_cli(["export", str(ckpt), "--format", "speculators", "--output", str(out), "--target",
                    str(model_dir)], capsys)[0] == 0
    cls = get_drafter_class("dspark-markov")
    fresh = cls.build(cls.from_pretrained(ckpt, target).config, target)
    _load_initial_weights(fresh, out, target)
    for name, tensor in cls.from_pretrained(ckpt, target).net.state_dict().items():
        assert torch.equal(fresh.net.state_dict()[name], tensor), name

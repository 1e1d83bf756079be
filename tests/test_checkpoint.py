"""The drafter checkpoint format: config.json fields, validation against the target, old layouts, model cards."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_qwen3, tiny_target, tiny_tokenizer
from transformers import AutoModelForCausalLM, Qwen3Config

from dspec_cli.checkpoints.model_card import MEASURED_BEGIN, refresh_model_card
from dspec_cli.checkpoints.native import target_id, tokenizer_fingerprint
from dspec_cli.core.errors import DspecError
from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.core.version import __version__
from dspec_cli.runtime.target import Target

DFLASH = get_drafter_class("dflash")


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny_target("qwen3", seed=0)


def save(target: Target, path):
    torch.manual_seed(0)
    DFLASH.build(DFLASH.config_class(block_size=3, num_layers=1), target).save_pretrained(path)
    return path


def test_config_json_records_the_drafter_and_its_target(target, tmp_path):
    cfg = json.loads((save(target, tmp_path) / "config.json").read_text())
    assert cfg["drafter"] == "dflash" and cfg["dspec_version"] == __version__
    assert cfg["architectures"] == ["DspecDflashDrafter"]
    assert cfg["target"] == {"name_or_path": "", "vocab_size": 384, "hidden_size": 64, "num_hidden_layers": 3,
                             "tokenizer_sha256": tokenizer_fingerprint(tiny_tokenizer())}
    settings = cfg["drafter_config"]
    assert settings["block_size"] == 3 and settings["head"] == "none" and settings["target_layer_ids"] == [1]
    assert settings["mask_token_id"] == target.tokenizer.pad_token_id


def test_loading_checks_the_target_and_accepts_old_configs(target, tmp_path):
    path = save(target, tmp_path)
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|mask|>"]})
    with pytest.raises(DspecError, match="tokenizer differs from the drafter's .*token ids would not match"):
        DFLASH.from_pretrained(path, Target(tiny_qwen3(), tok))
    deeper = AutoModelForCausalLM.from_config(Qwen3Config(**{**target.config.to_dict(), "num_hidden_layers": 4, "layer_types": None}),
                                              attn_implementation="sdpa")
    with pytest.raises(DspecError, match="target layer count 3 does not match the target's 4"):
        DFLASH.from_pretrained(path, Target(deeper, tiny_tokenizer()))

    raw = json.loads((path / "config.json").read_text())
    old = {"drafter": raw["drafter"], "drafter_config": raw["drafter_config"]}  # written before the target section
    (path / "config.json").write_text(json.dumps(old))
    assert DFLASH.from_pretrained(path, Target(tiny_qwen3(), tok)).config.block_size == 3

    (path / "calibration.json").write_text(json.dumps({"drafter": "eagle3", "block_size": 1, "temperatures": [1.0]}))
    with pytest.raises(DspecError, match="is for drafter 'eagle3', not 'dflash'"):
        DFLASH.from_pretrained(path, target)
    (path / "calibration.json").unlink()
    (path / "cost_table.json").write_text("{}")
    with pytest.raises(DspecError, match=r"cost_table.json: device: missing"):
        DFLASH.from_pretrained(path, target)
    (path / "config.json").write_text("[]")
    with pytest.raises(DspecError, match="config.json must be an object"):
        DFLASH.from_pretrained(path, target)


def test_target_id(model_dir, monkeypatch):
    loaded = Target.load(str(model_dir))
    assert target_id(loaded) == str(model_dir.resolve())
    monkeypatch.setattr("dspec_cli.checkpoints.native.DEFAULT_TARGET_PATH", model_dir)
    assert target_id(loaded) == "embedded"
    loaded.model.config._name_or_path = "/cache/hub/models--Qwen--Qwen3-4B/snapshots/0123abc"
    assert target_id(loaded) == "Qwen/Qwen3-4B"


def test_refreshed_card_keeps_the_authors_text(tmp_path):
    (tmp_path / "README.md").write_text(
        "---\nlicense: mit\ntags:\n- custom\n---\n# My drafter\n\nHand-written notes.\n\n"
        f"{MEASURED_BEGIN}\nstale numbers\n<!-- /dspec:measured -->\n\nFooter.\n"
    )
    (tmp_path / "calibration.json").write_text(json.dumps({"temperatures": [2.0, 1.0]}))
    config = {"drafter": "dspark-markov", "target": {"name_or_path": "Qwen/Qwen3-4B"}, "drafter_config": {}}
    card = refresh_model_card(tmp_path, config)
    assert card.startswith("---\nlicense: mit\n") and "library_name: dspec" in card
    assert "base_model: Qwen/Qwen3-4B" in card and "- custom\n- speculative-decoding\n- dspark-markov" in card
    assert "Hand-written notes." in card and "Footer." in card and "stale numbers" not in card
    assert card.count(MEASURED_BEGIN) == 1 and "temperatures per position [2, 1]" in card
    assert refresh_model_card(tmp_path, config) == card


BAD_CONFIGS = [  # (what is wrong, edit of a good config.json, the field the error names)
    ("no drafter_config", lambda c: c.pop("drafter_config"), "drafter_config: missing"),
    ("block size as a string", lambda c: c["drafter_config"].update(block_size="3"), "drafter_config.block_size"),
    ("block size 0", lambda c: c["drafter_config"].update(block_size=0), "drafter_config.block_size must be >= 1"),
    ("fractional block size", lambda c: c["drafter_config"].update(block_size=2.5), "drafter_config.block_size"),
    ("no block size", lambda c: c["drafter_config"].pop("block_size"), "drafter_config.block_size: missing"),
    ("NaN", lambda c: c["drafter_config"].update(rms_norm_eps=float("nan")), "NaN is not a JSON number"),
    ("Infinity in the target", lambda c: c["target"].update(extra=[1, float("inf")]), "Infinity is not a JSON number"),
    ("target not an object", lambda c: c.update(target=[1]), "target: should be an object"),
    ("mistyped target size", lambda c: c["target"].update(hidden_size="64"), "target.hidden_size"),
    ("drafter not a string", lambda c: c.update(drafter=3), "drafter: should be a valid string"),
]


def _broken(target: Target, tmp_path, edit):
    path = save(target, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("edit,field", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_a_config_that_does_not_fit_its_record_names_the_file_and_field(target, tmp_path, edit, field):
    from dspec_cli.checkpoints.native import choose_target

    path = _broken(target, tmp_path, edit)
    for load in (lambda: choose_target(None, [path]), lambda: DFLASH.from_pretrained(path, target)):
        with pytest.raises(DspecError) as err:  # choose_target: what every command runs before a model loads
            load()
        assert str(err.value).startswith(f"checkpoint {path / 'config.json'}: {field}"), err.value


def test_drafter_config_fields_are_typed_by_the_drafter(target, tmp_path):
    for value, key, field in (("2", "num_layers", "num_layers"), (True, "num_layers", "num_layers"),
                              ([1.5], "target_layer_ids", r"target_layer_ids\[0\]")):
        path = _broken(target, tmp_path / key, lambda c, v=value, k=key: c["drafter_config"].update({k: v}))
        with pytest.raises(DspecError, match=f"config.json: {field}: should be a valid integer"):
            DFLASH.from_pretrained(path, target)
    path = _broken(target, tmp_path / "extra", lambda c: c["drafter_config"].update(colour="red"))
    with pytest.raises(DspecError, match="config.json: unknown key.s. colour; valid keys: block_size"):
        DFLASH.from_pretrained(path, target)
    with pytest.raises(DspecError, match="block size.*exceeds|--block-size 4 exceeds the 3 positions"):
        DFLASH.from_pretrained(save(target, tmp_path / "good"), target, block_size=4)


def test_bench_refuses_a_bad_config_before_any_model_loads(target, tmp_path, capsys, monkeypatch):
    from tiny_models import run_cli

    def no_model(*_args, **_kwargs):
        raise AssertionError("a model was loaded before the bad config.json was found")

    monkeypatch.setattr(Target, "load", no_model)
    path = _broken(target, tmp_path, lambda c: c["drafter_config"].update(block_size="7"))
    code, _, err = run_cli(["bench", "-d", "dflash", "--checkpoint", str(path), "--num-prompts", "1"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and "drafter_config.block_size must be >= 1 (an integer), got '7'" in lines[0]

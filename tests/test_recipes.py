"""Training recipes: schema, type checks, overrides, and the shipped recipes' settings."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dspec_cli.core import plugins
from dspec_cli.core.errors import DspecError
from dspec_cli.training.recipes import (
    Recipe,
    apply_overrides,
    load_recipe,
    parse_override,
    resume_conflicts,
)

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
HUB = {
    "qwen3-4b": ("Qwen/Qwen3-4B", [1, 9, 17, 25, 33], 151669),
    "qwen3-8b": ("Qwen/Qwen3-8B", [1, 9, 17, 25, 33], 151669),
    "qwen3-14b": ("Qwen/Qwen3-14B", [1, 10, 19, 28, 37], 151669),
    "gemma4-12b": ("google/gemma-4-12B-it", [5, 17, 29, 41, 46], 4),
}
# the serving engines' variants (docs/interop.md): z-lab's DFlash block, EAGLE-3 on three taps without q/k norms
SERVABLE = {"dflash": {"anchor_predicts": False}, "eagle3": {"qk_norm": False}}
DRAFTERS = ("dflash", "dspark-markov", "dspark-rnn", "eagle3")
ALL = sorted(RECIPES.glob("*/*.toml"))


def _write(tmp: Path, text: str) -> Path:
    path = tmp / "r.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_recipe_is_valid_for_its_drafter(path):
    recipe = load_recipe(path)
    assert recipe.drafter == path.stem and recipe.description
    registered = plugins.registry().drafters
    if recipe.drafter not in registered:
        pytest.skip(f"drafter {recipe.drafter} is not installed")
    config = recipe.drafter_config(registered[recipe.drafter].cls)
    assert config.block_size == 7


@pytest.mark.parametrize("folder", sorted(HUB))
def test_hub_recipes_carry_the_paper_settings(folder):
    name, layer_ids, mask = HUB[folder]
    for drafter in DRAFTERS:
        r = load_recipe(RECIPES / folder / f"{drafter}.toml")
        d, t = r.drafter_section, r.train
        assert r.target.name == name and r.target.dtype == "bfloat16"
        taps = [layer_ids[0], layer_ids[2], layer_ids[4]] if drafter == "eagle3" else layer_ids
        assert d["block_size"] == 7 and d["target_layer_ids"] == taps
        assert all(d[k] == v for k, v in SERVABLE.get(drafter, {}).items())
        assert d["num_layers"] == (1 if drafter == "eagle3" else 5)
        if drafter != "eagle3":
            assert d["mask_token_id"] == mask and d["num_anchors"] == 512
        if drafter.startswith("dspark"):
            assert d["markov_rank"] == 256 and (d["ce_weight"], d["l1_weight"], d["conf_weight"]) == (0.1, 0.9, 1.0)
        assert (t.lr, t.warmup_ratio, t.schedule, t.global_batch, t.epochs) == (6e-4, 0.04, "cosine", 512, 10)
        assert (t.grad_clip, t.weight_decay, t.dtype, r.data.max_length) == (1.0, 0.0, "bfloat16", 4096)
        assert (r.regenerate.temperature, r.regenerate.top_p, r.regenerate.top_k) == (0.7, 0.8, 20)


def test_tiny_recipes_target_the_embedded_default():
    for drafter in ("dflash", "dspark-markov", "dspark-rnn"):
        r = load_recipe(RECIPES / "tiny" / f"{drafter}.toml")
        assert r.target.name == "embedded" and r.regenerate.prompts == "work-data/tiny/prompts-train.jsonl"
        assert r.train.device == "cpu" and r.drafter_section["num_layers"] == 1


def test_unknown_keys_list_the_valid_ones(tmp_path):
    with pytest.raises(DspecError, match=r"unknown key\(s\) traget; valid keys: description, target, data"):
        load_recipe(_write(tmp_path, '[traget]\nname = "x"\n'))
    with pytest.raises(DspecError, match=r"unknown key\(s\) train.learning_rate; valid keys in \[train\]: epochs, max_steps"):
        load_recipe(_write(tmp_path, "[train]\nlearning_rate = 1.0\n"))
    with pytest.raises(DspecError, match=r"\[data\] must be a table"):
        load_recipe(_write(tmp_path, 'data = "x.jsonl"\n'))


def test_values_are_type_checked(tmp_path):
    assert load_recipe(_write(tmp_path, "[train]\nlr = 1\nbetas = [0, 0.5]\n")).train.betas == (0.0, 0.5)
    for body, message in [
        ("[train]\nglobal_batch = 8.0\n", "train.global_batch: should be a valid integer (got 8.0)"),
        ("[train]\nlr = true\n", "train.lr: should be a valid number (got True)"),
        ("[train]\nbetas = [0.9]\n", "train.betas[1]: missing"),
        ("[train]\nbetas = [0.9, 1]\n", "train.betas[1]: should be less than 1 (got 1)"),
        ("[target]\nname = 3\n", "target.name: should be a valid string"),
        ("[train]\nschedule = \"step\"\n", "train.schedule: should be 'cosine', 'linear' or 'constant'"),
        ("[train]\nmicro_batch = 0\n", "train.micro_batch: should be greater than or equal to 1"),
        ("[train]\nlr = nan\n", "train.lr: should be a finite number"),
        ("[regenerate]\nmax_new_tokens = 0\n", "regenerate.max_new_tokens: should be greater than or equal to 1"),
        ("description = \"x\" x", "not valid TOML"),
    ]:
        with pytest.raises(DspecError, match=re.escape(message)):
            load_recipe(_write(tmp_path, body))
    with pytest.raises(DspecError, match="file not found"):
        load_recipe(tmp_path / "missing.toml")


def test_overrides_parse_toml_values_or_plain_strings(tmp_path):
    assert parse_override("train.lr=3e-4") == (["train", "lr"], 3e-4)
    assert parse_override("target.name=Qwen/Qwen3-8B") == (["target", "name"], "Qwen/Qwen3-8B")
    assert parse_override("drafter.target_layer_ids=[1, 2]") == (["drafter", "target_layer_ids"], [1, 2])
    for bad in ("lr", "=3", "train..lr=1"):
        with pytest.raises(DspecError, match="expected KEY=VALUE"):
            parse_override(bad)
    with pytest.raises(DspecError, match="at most two levels"):
        apply_overrides({}, ["a.b.c=1"])
    path = _write(tmp_path, "[train]\nlr = 1e-3\n[drafter]\nname = \"dflash\"\nnum_layers = 5\n")
    r = load_recipe(path, ["train.lr=2e-4", "drafter.num_layers=2", "data.limit=10"])
    assert (r.train.lr, r.drafter_section["num_layers"], r.data.limit, r.drafter) == (2e-4, 2, 10, "dflash")
    with pytest.raises(DspecError, match=re.escape("override 'train.epochs=many': should be a valid number (got 'many')")):
        load_recipe(path, ["train.epochs=many"])


def test_drafter_section_checked_against_the_config_class(tmp_path):
    from test_training import ProbeDrafter

    r = load_recipe(_write(tmp_path, "[drafter]\nname = \"p\"\ntarget_layer_ids = [0, 1]\nkeep = 1\n"))
    cfg = r.drafter_config(ProbeDrafter)
    assert cfg.target_layer_ids == (0, 1) and cfg.keep == 1.0
    with pytest.raises(DspecError, match=r"drafter.keep: expected a number"):
        load_recipe(_write(tmp_path, "[drafter]\nkeep = \"all\"\n")).drafter_config(ProbeDrafter)
    with pytest.raises(DspecError, match=r"unknown key\(s\) layers; valid keys: block_size, target_layer_ids, keep"):
        load_recipe(_write(tmp_path, "[drafter]\nlayers = 2\n")).drafter_config(ProbeDrafter)


def test_round_trip_and_resume_safe_keys():
    r = load_recipe(RECIPES / "qwen3-4b" / "dspark-markov.toml")
    again = Recipe.from_dict(json.loads(json.dumps(r.to_dict())), source="copy")
    assert again.to_dict() == r.to_dict() and resume_conflicts(r, again) == []
    changed = Recipe.from_dict(apply_overrides(r.to_dict(), ["train.save_every=10", "train.lr=1e-4",
                                                             "drafter.markov_rank=64", "regenerate.limit=5"]))
    assert resume_conflicts(r, changed) == ["drafter.markov_rank", "train.lr"]

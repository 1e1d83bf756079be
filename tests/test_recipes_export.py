"""Every shipped recipe, shrunk to a tiny random target with the recipe's layer count and taps
(recipe overrides only), trains 2 steps, exports for every engine that serves its drafter, loads
the export back and benches it; the engines that refuse it refuse with the reason. (The export
and bench commands themselves are tested in test_export.py and test_bench_cli.py; here the
target is loaded once per recipe: a 48-layer model takes seconds to load.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_training import write_conversations
from tiny_models import _special_ids, tiny_tokenizer
from transformers import AutoModelForCausalLM, Gemma4TextConfig, Qwen3Config

from dspec_cli.checkpoints.serving import FORMATS, serving_methods
from dspec_cli.core import plugins
from dspec_cli.core.errors import DspecError
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.runtime.target import Target
from dspec_cli.training.loop import TrainOptions, train
from dspec_cli.training.recipes import load_recipe
from dspec_cli.workflows.export import export
from dspec_cli.workflows.metrics import acceptance

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
ALL = sorted(RECIPES.rglob("*.toml"))
# the engines that serve each drafter kind as the recipes train it (docs/interop.md)
SERVED = {"dflash": {"vllm", "sglang"}, "dspark-markov": {"vllm", "sglang"}, "dspark-rnn": {"sglang"},
          "eagle3": {"vllm", "sglang"}}
SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             max_position_embeddings=512, vocab_size=384, initializer_range=0.2, **_special_ids())


def _layers(recipe) -> int:
    """The recipe's target layer count (given, else the deepest tap + 2, Gemma-4-12B's 48 for its taps)."""
    return recipe.target.num_layers or max(recipe.drafter_section.get("target_layer_ids", [0])) + 2


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """(family, layers) -> folder of a saved tiny random target, built once per module."""
    made: dict[tuple[str, int], Path] = {}

    def get(family: str, layers: int) -> Path:
        if (family, layers) not in made:
            if family == "gemma4":
                kinds = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]
                config = Gemma4TextConfig(**{**SMALL, "num_hidden_layers": layers}, layer_types=kinds, sliding_window=8,
                                          global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
                                          hidden_size_per_layer_input=0, tie_word_embeddings=False)
            else:
                config = Qwen3Config(**{**SMALL, "num_hidden_layers": layers}, tie_word_embeddings=True)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
            path = tmp_path_factory.mktemp(f"{family}-{layers}")
            model.save_pretrained(path)
            tiny_tokenizer().save_pretrained(path)
            made[family, layers] = path
        return made[family, layers]

    return get


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("data") / "conv.jsonl", 4)


def shrink(recipe_path: Path, target: Path, conversations: Path) -> list[str]:
    """Overrides that keep the recipe's drafter settings (layers, taps, block, heads) on a tiny target."""
    section = load_recipe(recipe_path).drafter_section
    out = [f"target.name={target}", "target.vocab_size=0", "target.hidden_size=0", "target.num_layers=0",
           "target.dtype=float32", f"data.path={conversations}", "data.limit=0", "data.max_length=64",
           "data.min_loss_tokens=4", "train.global_batch=2", "train.micro_batch=2", "train.max_steps=2",
           "train.save_every=0", "train.device=cpu", "train.dtype=float32"]
    if "mask_token_id" in section:
        out.append("drafter.mask_token_id=-1")  # the tiny tokenizer's own
    if "num_anchors" in section:
        out.append("drafter.num_anchors=4")
    if section.get("markov_rank"):
        out.append("drafter.markov_rank=8")
    if "ttt_length" in section:
        out.append("drafter.ttt_length=2")
    return out


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(RECIPES).with_suffix("")))
def test_shipped_recipe_trains_exports_loads_and_benches(path, targets, data, tmp_path):
    recipe = load_recipe(path)
    if recipe.drafter not in plugins.registry().drafters:
        pytest.skip(f"drafter {recipe.drafter} is not installed")
    family = "gemma4" if "gemma" in recipe.target.name else "qwen3"
    folder = targets(family, _layers(recipe))
    result = train(TrainOptions(recipe=path, output=tmp_path / "run", overrides=shrink(path, folder, data)))
    assert result.finished
    cls = plugins.get_drafter_class(recipe.drafter)
    target = Target.load(str(folder))
    drafter = cls.from_pretrained(result.output, target)
    assert list(drafter.target_layer_ids) == recipe.drafter_section["target_layer_ids"]
    served, refused = serving_methods(drafter, target)
    assert set(served) == SERVED[recipe.drafter] and set(refused) == set(FORMATS) - set(served)
    prompts = [target.render_prompt("Tell me about the sea."), target.render_prompt("def add(a, b):")]
    for fmt in FORMATS:
        out = tmp_path / f"export-{fmt}"
        if fmt in refused:
            with pytest.raises(DspecError, match=re.escape(refused[fmt])):
                export(drafter, target, fmt, out, str(folder), checkpoint=result.output)
            assert not out.exists()
            continue
        report = export(drafter, target, fmt, out, str(folder), checkpoint=result.output)
        assert report["method"] == served[fmt] and report["command"]
        back = cls.from_pretrained(out, target)  # the engine's layout, through the interop loader
        assert back.config.target_layer_ids == drafter.config.target_layer_ids
        config = GenerationConfig(max_new_tokens=8, block_size=back.config.block_size, max_batch=2, seed=1)
        results = SpeculativeEngine(target, back, config).generate(prompts)
        assert acceptance(results, back.config.block_size)["tau"] >= 1


class Notes:
    """A training progress that keeps the notes."""

    def __init__(self):
        self.notes: list[str] = []

    def start(self, total, done, title):
        pass

    def update(self, row):
        pass

    def note(self, text):
        self.notes.append(text)


@pytest.mark.parametrize("extra, said", [
    ([], "servable after training by vLLM (dflash), SGLang (DFLASH)"),
    (["drafter.anchor_predicts=true"], "no serving engine loads this drafter (dflash in DeepSpec's block layout"),
])
def test_train_says_which_engines_serve_the_result_before_step_1(extra, said, targets, data, tmp_path):
    path = RECIPES / "tiny" / "dflash.toml"
    folder = targets("qwen3", 6)
    progress = Notes()
    overrides = [*shrink(path, folder, data), "train.max_steps=1", *extra]
    train(TrainOptions(recipe=path, output=tmp_path / "run", overrides=overrides), progress)
    assert any(said in n for n in progress.notes), progress.notes

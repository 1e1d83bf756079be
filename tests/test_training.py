"""dspec train: data tokenisation, the loop, checkpoints, exact resume, feature cache, torchrun.

A test-only trainable drafter (a linear probe from the target's taps to next-token logits through
the target's frozen LM head) exercises the TrainableDrafter contract, including randomness
inside ``training_loss`` so that exact resume depends on the restored RNG states.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import run_cli, tiny_qwen3, tiny_tokenizer

from dspec_cli import hookimpl
from dspec_cli.checkpoints.config import DrafterConfig
from dspec_cli.core import plugins
from dspec_cli.core.data import Conversation
from dspec_cli.core.errors import DspecError
from dspec_cli.runtime.drafter import TrainableDrafter
from dspec_cli.training.data import (
    DataOrder,
    assistant_spans,
    end_of_turn,
    tokenize_conversations,
)
from dspec_cli.training.loop import TrainOptions, lr_factor, train

TESTS = Path(__file__).resolve().parent

PROBE = "test-linear-probe"


@dataclass
class ProbeConfig(DrafterConfig):
    target_layer_ids: tuple[int, ...] = (0, 2)
    keep: float = 0.7  # share of valid positions used per step (random: exercises the RNG)


class ProbeDrafter(TrainableDrafter):
    """taps_t -> Linear -> target LM head: predicts token t+1 inside assistant spans."""

    name = PROBE
    config_class = ProbeConfig
    capabilities = frozenset({"trainable"})

    def __init__(self, config: ProbeConfig, target):
        super().__init__(config, target)
        n = len(config.target_layer_ids)
        self.net = torch.nn.Linear(n * target.hidden_size, target.hidden_size, bias=False)

    def training_loss(self, batch, target_features):
        ids, mask = batch["input_ids"], batch["loss_mask"].bool()  # [B, L]
        valid = mask[:, :-1] & mask[:, 1:]  # [B, L-1]
        valid &= torch.rand(valid.shape, device=ids.device) < self.config.keep
        head = self.target.model.get_output_embeddings()
        logits = head(self.net(target_features["taps"][:, :-1].float()))  # [B, L-1, V]
        with torch.no_grad():
            p_t = torch.softmax(head(target_features["last_hidden"][:, :-1]).float(), -1)
        if not valid.any():
            zero = logits.sum() * 0
            return {"loss": zero, "tau_probabilistic": 1.0}
        ce = F.cross_entropy(logits[valid], ids[:, 1:][valid])
        accept = 1 - 0.5 * (torch.softmax(logits[valid].detach(), -1) - p_t[valid]).abs().sum(-1)
        return {"loss": ce, "tau_probabilistic": 1 + accept.mean()}


class _ProbePlugin:
    @hookimpl
    def dspec_register_drafters(self, register):
        register(ProbeDrafter)


def register_probe() -> None:
    if plugins.pm.get_plugin(PROBE) is None:
        plugins.pm.register(_ProbePlugin(), name=PROBE)


SENTENCES = [
    "The capital of France is Paris, and it sits on the river.",
    "Speculative decoding drafts several tokens with a small model and verifies them.",
    "def add(a, b):\n    return a + b",
    "Waves roll in, waves roll out, the gulls cry over the sea.",
    "Numbers like 1 2 3 4 5 6 7 8 9 10 42 and 100 appear in text.",
    "A target model scores every drafted token in one forward pass.",
]


def write_conversations(path: Path, n: int = 12) -> Path:
    lines = []
    for i in range(n):
        conv = [{"role": "user", "content": f"Question {i}: tell me something."},
                {"role": "assistant", "content": SENTENCES[i % len(SENTENCES)] + " " + SENTENCES[(i + 1) % len(SENTENCES)]}]
        if i % 3 == 0:
            conv += [{"role": "user", "content": "More, please."},
                     {"role": "assistant", "content": SENTENCES[(i + 2) % len(SENTENCES)]}]
        lines.append(json.dumps({"id": f"c{i}", "conversations": conv}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3 target with the ChatML tokenizer, saved like a Hub checkpoint."""
    path = tmp_path_factory.mktemp("target") / "tiny-qwen3"
    tiny_qwen3().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def probe():
    register_probe()
    yield PROBE
    plugins.pm.unregister(name=PROBE)


def make_recipe(tmp: Path, target: Path, data: Path, **train) -> Path:
    settings = {"global_batch": 4, "micro_batch": 2, "max_steps": 6, "lr": 3e-3, "warmup_ratio": 0.2,
                "save_every": 3, "seed": 5, **train}
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in settings.items())
    path = tmp / "recipe.toml"
    path.write_text(textwrap.dedent(f"""\
        description = "test recipe"
        [target]
        name = "{target}"
        hidden_size = 64
        [data]
        path = "{data}"
        max_length = 96
        min_loss_tokens = 4
        [drafter]
        name = "{PROBE}"
        target_layer_ids = [-1, 1]
        [train]
        """) + body + "\n")
    return path


@pytest.fixture()
def setup(tmp_path, tiny_dir, probe):
    data = write_conversations(tmp_path / "conv.jsonl")
    return tmp_path, make_recipe(tmp_path, tiny_dir, data)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# -- data -------------------------------------------------------------------------------------------


def test_loss_mask_covers_assistant_content_and_end_of_turn():
    tok = tiny_tokenizer()
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello you"},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "See you"}]
    data = tokenize_conversations([Conversation("a", msgs, "f:1")], tok, 512, 1, "f")
    ids, mask = data.sample(0)
    masked = tok.decode([int(i) for i, m in zip(ids, mask, strict=True) if m])
    assert masked == "Hello you<|im_end|>\nSee you<|im_end|>\n"
    assert end_of_turn(tok) == "<|im_end|>\n"
    # truncation keeps the first max_length tokens
    short = tokenize_conversations([Conversation("a", msgs, "f:1")], tok, 20, 1, "f")
    assert short.num_tokens == 20 and (short.mask == mask[:20]).all()


def test_loss_mask_skips_template_thinking_stub():
    tok = tiny_tokenizer()
    tok.chat_template = (  # Qwen3-like: an empty think block before the last assistant turn
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Answer here"}]
    data = tokenize_conversations([Conversation("a", msgs, "f:1")], tok, 512, 1, "f")
    ids, mask = data.sample(0)
    assert tok.decode([int(i) for i, m in zip(ids, mask, strict=True) if m]) == "Answer here<|im_end|>\n"


def test_no_assistant_tokens_is_an_error_and_short_samples_are_counted():
    tok = tiny_tokenizer()
    users = [Conversation(str(i), [{"role": "user", "content": "hello"}], f"f:{i}") for i in range(3)]
    with pytest.raises(DspecError, match="data has no assistant tokens"):
        tokenize_conversations(users, tok, 64, 1, "f")
    mixed = users + [Conversation("x", [{"role": "user", "content": "q"},
                                         {"role": "assistant", "content": "a long enough answer here"}], "f:9")]
    data = tokenize_conversations(mixed, tok, 64, 4, "f")
    assert len(data) == 1 and data.skipped == 3 and data.sample_ids == ["x"]


def test_assistant_text_equal_to_user_text_is_found_after_it():
    text = "<u>same<e>\n<a>same<e>\n"
    msgs = [{"role": "user", "content": "same"}, {"role": "assistant", "content": "same"}]
    assert assistant_spans(text, msgs, "<e>\n", "f:1") == [(text.index("<a>") + 3, len(text))]


def test_data_path_takes_several_files_in_order_with_one_limit(tmp_path):
    from dspec_cli.training.data import load_train_data

    tok = tiny_tokenizer()
    a = write_conversations(tmp_path / "a.jsonl", n=4)
    b = write_conversations(tmp_path / "b.jsonl", n=3)
    both = load_train_data([str(a), str(b)], tok, 96, 1)
    one = load_train_data([str(a)], tok, 96, 1)
    assert len(both) == 7 and both.sample_ids[:4] == one.sample_ids
    assert np.array_equal(both.sample(0)[0], one.sample(0)[0])
    assert len(load_train_data([str(a), str(b)], tok, 96, 1, limit=5)) == 5
    assert len(load_train_data([str(a), str(b)], tok, 96, 1, limit=2)) == 2
    with pytest.raises(DspecError, match="data.path is empty"):
        load_train_data([], tok, 96, 1)


def test_recipe_data_path_accepts_a_list_and_names_the_missing_file(setup, tmp_path):
    tmp, recipe = setup
    data = tmp / "conv.jsonl"
    with pytest.raises(DspecError, match=r"training data '.*missing.jsonl' \(data.path\) not found"):
        train(TrainOptions(recipe=recipe, output=tmp / "new",
                           overrides=[f'data.path=["{data}", "{tmp / "missing.jsonl"}"]']))
    assert not (tmp / "new").exists()


def test_data_order_is_a_seeded_stream_of_epoch_permutations_sharded_by_rank():
    order = DataOrder(10, 4, seed=3)
    stream = [i for s in range(5) for i in order.step_indices(s)]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert DataOrder(10, 4, seed=3).step_indices(3) == order.step_indices(3)  # position = step only
    shards = [order.micro_batches(2, r, 2, 1) for r in range(2)]
    assert sorted(i for s in shards for mb in s for i in mb) == sorted(order.step_indices(2))
    assert order.steps_for(2.0) == 5


def test_lr_schedule_warmup_then_cosine_to_min():
    f = [lr_factor(s, 10, 2, "cosine", 0.1) for s in range(10)]
    assert f[0] == 0.5 and f[1] == 1.0 and f[2] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[1:], f[2:], strict=False)) and f[-1] > 0.1
    assert lr_factor(10, 10, 2, "cosine", 0.1) == pytest.approx(0.1)


# -- the loop ---------------------------------------------------------------------------------------


def test_train_writes_loadable_drafter_checkpoints_log_and_card(setup):
    tmp, recipe = setup
    out = tmp / "run"
    res = train(TrainOptions(recipe=recipe, output=out))
    assert res.finished and res.step == 6 and res.total_steps == 6
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_6"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_3", "step_6"]
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all({"loss", "lr", "tau_probabilistic", "tokens_per_s", "grad_norm"} <= set(r) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    card = (out / "README.md").read_text()
    assert PROBE in card and "6 of 6" in card and "conv.jsonl" in card
    from dspec_cli.runtime.target import Target

    tgt = Target.load(json.loads((out / "checkpoints" / "step_6" / "recipe.json").read_text())["target"]["name"])
    loaded = ProbeDrafter.from_pretrained(out, tgt)
    assert torch.equal(loaded.net.weight, _weights(out)["weight"])
    assert torch.equal(_weights(out)["weight"], _weights(out / "checkpoints" / "step_6")["weight"])


def test_resume_after_stop_matches_uninterrupted_run(setup):
    tmp, recipe = setup
    full = train(TrainOptions(recipe=recipe, output=tmp / "full"))
    part = train(TrainOptions(recipe=recipe, output=tmp / "part", stop_after=4))
    assert not part.finished and part.step == 4
    assert not (tmp / "part" / "model.safetensors").exists()
    # the interrupted run only kept step_3; simulate losing step_4 as a crash would
    import shutil

    shutil.rmtree(tmp / "part" / "checkpoints" / "step_4")
    (tmp / "part" / "checkpoints" / "latest").write_text("step_3\n")
    resumed = train(TrainOptions(recipe=recipe, output=tmp / "part", resume=True))
    assert resumed.finished and resumed.step == 6
    a, b = _weights(full.output), _weights(resumed.output)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line)["step"] for line in (tmp / "part" / "train_log.jsonl").read_text().splitlines()]
    assert rows == list(range(1, 7))  # rows past the checkpoint were replaced, not duplicated
    log_full = [json.loads(line)["loss"] for line in (tmp / "full" / "train_log.jsonl").read_text().splitlines()]
    log_part = [json.loads(line)["loss"] for line in (tmp / "part" / "train_log.jsonl").read_text().splitlines()]
    assert log_full == log_part


def test_ctrl_c_stops_at_a_step_boundary_with_a_checkpoint(setup):
    import signal

    tmp, recipe = setup

    class Interrupt:
        def start(self, total, done, title):
            pass

        def update(self, row):
            if row["step"] == 2:
                os.kill(os.getpid(), signal.SIGINT)

        def note(self, text):
            pass

    before = signal.getsignal(signal.SIGINT)  # default, or SIG_IGN under nohup / background jobs
    res = train(TrainOptions(recipe=recipe, output=tmp / "run"), Interrupt())
    assert not res.finished and res.interrupted and res.step == 2 and res.checkpoint.name == "step_2"
    assert signal.getsignal(signal.SIGINT) == before  # the previous handler is restored
    full = train(TrainOptions(recipe=recipe, output=tmp / "full"))
    resumed = train(TrainOptions(output=tmp / "run", resume=True))
    assert torch.equal(_weights(full.output)["weight"], _weights(resumed.output)["weight"])


def test_cli_ctrl_c_exits_130_after_the_checkpoint(setup, capsys, monkeypatch):
    import signal

    from dspec_cli.cli import train as train_cli

    tmp, recipe = setup
    update = train_cli.RichProgress.update

    def interrupt_at_step_2(self, row):
        update(self, row)
        if row["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(train_cli.RichProgress, "update", interrupt_at_step_2)
    code, out, err = run_cli(["train", "--recipe", str(recipe), "--output", str(tmp / "cli-int")], capsys)
    assert code == 130 and err.strip().splitlines()[-1] == "Interrupted", err
    assert "stopped at step 2/" in out and (tmp / "cli-int" / "checkpoints" / "step_2").is_dir()


def test_failed_starts_overwrite_nothing(setup, tmp_path):
    tmp, recipe = setup
    out = tmp / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(DspecError, match="not empty"):
        train(TrainOptions(recipe=recipe, output=out))
    with pytest.raises(DspecError, match="no checkpoint"):
        train(TrainOptions(recipe=recipe, output=out, resume=True))
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(DspecError, match="is for target"):
        train(TrainOptions(recipe=recipe, output=tmp / "new", target="Qwen/Qwen3-4B"))
    with pytest.raises(DspecError, match="expects 32"):
        train(TrainOptions(recipe=recipe, output=tmp / "new", overrides=["target.hidden_size=32"]))
    with pytest.raises(DspecError, match=r"override 'train.lr=fast': should be a valid number"):
        train(TrainOptions(recipe=recipe, output=tmp / "new", overrides=["train.lr=fast"]))
    with pytest.raises(DspecError, match=r"unknown key\(s\) layers; valid keys: block_size, target_layer_ids, keep"):
        train(TrainOptions(recipe=recipe, output=tmp / "new", overrides=["drafter.layers=3"]))
    assert not (tmp / "new").exists()


def test_resume_refuses_another_drafters_checkpoint_and_changed_recipe(setup):
    tmp, recipe = setup
    out = tmp / "run"
    train(TrainOptions(recipe=recipe, output=out, stop_after=3))
    state = out / "checkpoints" / "step_3" / "trainer_state.json"
    with pytest.raises(DspecError, match="differs from the checkpoint's in train.lr"):
        train(TrainOptions(recipe=recipe, output=out, resume=True, overrides=["train.lr=1e-3"]))
    saved = json.loads(state.read_text())
    state.write_text(json.dumps({**saved, "drafter": "dflash"}))
    with pytest.raises(DspecError, match="is a 'dflash' checkpoint"):
        train(TrainOptions(recipe=recipe, output=out, resume=True))
    state.write_text(json.dumps(saved))
    with pytest.raises(DspecError, match=r"--resume: train.max_steps 6 -> 9 would make the run differ .* "
                                         r"start a new run from its weights with --init-from .*step_3$"):
        train(TrainOptions(output=out, resume=True, max_steps=9))  # no --recipe: nothing to "omit"
    with pytest.raises(DspecError, match="holds no run to continue; start one with --recipe RECIPE"):
        train(TrainOptions(output=tmp / "nothing-here", resume=True))
    res = train(TrainOptions(output=out, resume=True))  # the checkpoint's own recipe
    assert res.finished and res.step == 6


def test_feature_cache_is_written_then_reused(setup, monkeypatch):
    tmp, recipe = setup
    cache = tmp / "features"
    first = train(TrainOptions(recipe=recipe, output=tmp / "a", feature_cache=cache, max_steps=2))
    assert (cache / "manifest.json").is_file() and len(list(cache.glob("*/*.safetensors"))) > 0
    import dspec_cli.training.data as td

    def boom(*_a, **_k):
        raise AssertionError("target forward despite a full cache")

    monkeypatch.setattr(td, "target_features", boom)
    second = train(TrainOptions(recipe=recipe, output=tmp / "b", feature_cache=cache, max_steps=2))
    a, b = _weights(first.output), _weights(second.output)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_feature_cache_refuses_a_retrained_target_under_the_same_name(tmp_path, tiny_dir, probe):
    import shutil

    from transformers import AutoModelForCausalLM

    target = tmp_path / "target"
    shutil.copytree(tiny_dir, target)
    recipe = make_recipe(tmp_path, target, write_conversations(tmp_path / "conv.jsonl"))
    cache = tmp_path / "features"
    train(TrainOptions(recipe=recipe, output=tmp_path / "a", feature_cache=cache, max_steps=1))
    model = AutoModelForCausalLM.from_pretrained(target)
    with torch.no_grad():
        model.model.norm.weight.add_(0.01)  # the last parameter: a small retraining step
    model.save_pretrained(target)
    with pytest.raises(DspecError, match="was built with different target_weights"):
        train(TrainOptions(recipe=recipe, output=tmp_path / "b", feature_cache=cache, max_steps=1))


def test_cli_train_and_one_line_errors(setup, capsys):
    from dspec_cli.cli import main

    tmp, recipe = setup
    log = tmp / "metrics.jsonl"
    main(["train", "--recipe", str(recipe), "--output", str(tmp / "cli"), "--max-steps", "2",  # drafter: the recipe's
          "--json-log", str(log), "train.lr=1e-3"])
    assert "trained 2 steps" in capsys.readouterr().out
    assert (tmp / "cli" / "config.json").is_file() and len(log.read_text().splitlines()) == 2
    assert json.loads((tmp / "cli" / "checkpoints" / "step_2" / "recipe.json").read_text())["train"]["lr"] == 1e-3
    for args, message in [
        (["--output", str(tmp / "cli")], "not empty"),
        (["--output", str(tmp / "x"), "--drafter", "prompt-lookup"], "is for drafter"),
        (["--output", str(tmp / "x"), "train.nope=1"], "unknown key(s) train.nope; valid keys in [train]: epochs"),
        (["--output", str(tmp / "x"), "--max-steps", "0"], "Invalid value for '--max-steps'"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(["train", "--recipe", str(recipe), *args])
        err = capsys.readouterr().err
        assert exc.value.code in (1, 2) and err.count("\n") == 1 and message in err, err


def test_torchrun_two_processes_match_one_process(setup):
    """2 ranks x 2 micro-batches of 1 = 1 rank x 4: same samples per step, averaged gradients."""
    tmp, recipe = setup
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), str(TESTS.parent / "plugins")]),
           "OMP_NUM_THREADS": "1"}
    script = tmp / "dspec_with_probe.py"
    script.write_text("from test_training import register_probe\nregister_probe()\n"
                      "from dspec_cli.cli import main\nmain()\n")
    out, same = tmp / "ddp", ["drafter.keep=1.0", "train.micro_batch=1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), "train", "--recipe", str(recipe), "--output", str(out), "--max-steps", "3", *same]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("trained 3 steps") == 1  # rank 0 reports
    state = json.loads((out / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["accumulation"] == 2
    rng = torch.load(out / "checkpoints" / "step_3" / "rng_state.pt", weights_only=True)
    assert len(rng) == 2 and not torch.equal(rng[0]["torch"], rng[1]["torch"])
    single = train(TrainOptions(recipe=recipe, output=tmp / "single", max_steps=3, overrides=same))
    a, b = _weights(out), _weights(single.output)
    assert torch.allclose(a["weight"], b["weight"], atol=1e-5)
    from dspec_cli.runtime.target import Target

    tgt = Target.load(json.loads((out / "checkpoints" / "step_3" / "recipe.json").read_text())["target"]["name"])
    assert torch.equal(ProbeDrafter.from_pretrained(out, tgt).net.weight, a["weight"])


def test_tiny_recipe_trains_a_real_drafter_and_resumes_exactly(tmp_path, tiny_dir):
    """recipes/tiny/dspark-markov.toml on the tiny random target (sizes overridden)."""
    name = "dspark-markov"
    if name not in plugins.registry().drafters:
        pytest.skip(f"{name} is not installed")
    recipe = TESTS.parent / "recipes" / "tiny" / f"{name}.toml"
    data = write_conversations(tmp_path / "conv.jsonl", 8)
    overrides = [f"target.name={tiny_dir}", "target.vocab_size=0", "target.hidden_size=0", "target.num_layers=0",
                 f"data.path={data}", "data.max_length=96", "drafter.target_layer_ids=[0, 2]",
                 "drafter.num_anchors=8", "drafter.markov_rank=16", "train.global_batch=4", "train.micro_batch=2",
                 "train.max_steps=4", "train.save_every=2"]
    full = train(TrainOptions(recipe=recipe, output=tmp_path / "full", overrides=overrides))
    part = train(TrainOptions(recipe=recipe, output=tmp_path / "part", overrides=overrides, stop_after=2))
    resumed = train(TrainOptions(output=part.output, resume=True))
    assert full.finished and not part.finished and resumed.finished
    assert {"loss", "tau_probabilistic"} <= set(full.metrics)
    a, b = _weights(full.output), _weights(resumed.output)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
    from dspec_cli.runtime.target import Target

    target = Target.load(str(tiny_dir))
    drafter = plugins.get_drafter_class(name).from_pretrained(full.output, target)
    engine = SpeculativeEngine(target, drafter, GenerationConfig(max_new_tokens=8, temperature=1.0))
    assert len(engine.generate([target.render_prompt("hello")])[0].output_ids) >= 1


def test_eagle3_reduced_vocabulary_trains_through_the_pipeline(tmp_path, tiny_dir):
    """The loop calls prepare_training, so eagle3 builds d2t/t2d from the training data."""
    recipe = TESTS.parent / "recipes" / "tiny" / "eagle3.toml"
    data = write_conversations(tmp_path / "conv.jsonl", 8)
    overrides = [f"target.name={tiny_dir}", "target.vocab_size=0", "target.hidden_size=0", "target.num_layers=0",
                 f"data.path={data}", "data.max_length=96", "drafter.target_layer_ids=[0, 1, 2]",
                 "drafter.draft_vocab_size=64", "drafter.ttt_length=3", "train.global_batch=4", "train.micro_batch=2",
                 "train.max_steps=2", "train.save_every=2"]
    result = train(TrainOptions(recipe=recipe, output=tmp_path / "run", overrides=overrides))
    from dspec_cli.runtime.target import Target

    drafter = plugins.get_drafter_class("eagle3").from_pretrained(result.output, Target.load(str(tiny_dir)))
    assert drafter.net.draft_ids().numel() == 64


def test_init_from_fine_tunes_a_checkpoint_and_refuses_misfits(setup):
    """--init-from copies a drafter checkpoint's weights into a new run (lr 0 keeps them); another
    drafter's or another architecture's checkpoint is a one-line error; it excludes --resume."""
    tmp, recipe = setup
    base = train(TrainOptions(recipe=recipe, output=tmp / "base"))
    tuned = train(TrainOptions(recipe=recipe, output=tmp / "tuned", init_from=base.output,
                               overrides=["train.lr=0.0", "train.max_steps=2"]))
    assert tuned.finished and torch.equal(_weights(base.output)["weight"], _weights(tuned.output)["weight"])
    assert f"initialised from | `{base.output}`" in (tmp / "tuned" / "README.md").read_text()
    moved = train(TrainOptions(recipe=recipe, output=tmp / "moved", init_from=base.output,
                               overrides=["train.max_steps=2"]))
    assert not torch.equal(_weights(base.output)["weight"], _weights(moved.output)["weight"])
    with pytest.raises(DspecError, match="use one"):
        train(TrainOptions(recipe=recipe, output=tmp / "base", resume=True, init_from=base.output))
    with pytest.raises(DspecError, match="nowhere: not found"):
        train(TrainOptions(recipe=recipe, output=tmp / "x", init_from=tmp / "nowhere"))
    config = base.output / "config.json"
    raw = json.loads(config.read_text())
    config.write_text(json.dumps({**raw, "drafter": "dflash"}))
    with pytest.raises(DspecError, match="holds a 'dflash' drafter"):
        train(TrainOptions(recipe=recipe, output=tmp / "y", init_from=base.output))
    config.write_text(json.dumps(raw))
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(3, 3)}, str(base.output / "model.safetensors"))
    with pytest.raises(DspecError, match=r"weights do not fit the recipe's .* \(weight is \(3, 3\)"):
        train(TrainOptions(recipe=recipe, output=tmp / "z", init_from=base.output))
    assert not (tmp / "z").exists() or not any((tmp / "z").iterdir())


def test_report_to_tensorboard_writes_the_logged_rows_as_scalars(setup):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'dspec[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, recipe = setup
    out = tmp / "tb"
    train(TrainOptions(recipe=recipe, output=out, max_steps=3, report_to=["tensorboard"]))
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in rows] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    with pytest.raises(DspecError, match="--report-to 'wandb'"):
        train(TrainOptions(recipe=recipe, output=tmp / "tb2", max_steps=1, report_to=["wandb"]))


@pytest.mark.parametrize("shard", ["fsdp", "none"])
def test_torchrun_matches_one_process_and_resumes_exactly(setup, shard):
    """FSDP2 (train.shard=fsdp) or DDP (none) across 2 gloo ranks = 1 process; stop + --resume =
    uninterrupted, bit for bit."""
    tmp, recipe = setup
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), str(TESTS.parent / "plugins")]),
           "OMP_NUM_THREADS": "1"}
    script = tmp / "dspec_with_probe.py"
    script.write_text("from test_training import register_probe\nregister_probe()\n"
                      "from dspec_cli.cli import main\nmain()\n")
    same = ["drafter.keep=1.0", "train.micro_batch=1", f"train.shard={shard}"]

    def torchrun(*args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(script), "train", *args, *same]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
        causes = [line for line in res.stderr.splitlines() if re.search(r"terminate|what\(\)|Error|error:", line)]
        assert res.returncode == 0, "\n".join(causes[:20]) + "\n" + res.stderr[-1500:]
        return res

    full, part = tmp / f"{shard}-full", tmp / f"{shard}-part"
    torchrun("--recipe", str(recipe), "--output", str(full), "--max-steps", "3")
    torchrun("--recipe", str(recipe), "--output", str(part), "--max-steps", "3", "--stop-after", "2")
    res = torchrun("--resume", "--output", str(part))
    assert res.stdout.count("trained 3 steps") == 1
    assert torch.equal(_weights(full)["weight"], _weights(part)["weight"])  # bit-exact resume
    single = train(TrainOptions(recipe=recipe, output=tmp / f"{shard}-single", max_steps=3, overrides=same))
    assert torch.allclose(_weights(full)["weight"], _weights(single.output)["weight"], atol=1e-5)

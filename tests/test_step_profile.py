"""``profile-hardware --drafter`` profiles every drafter by verified width: chains are padded to the
cell's width (prompt lookup drafts nothing on random prompts), trees are timed at their own
width; the padding keeps verification exact."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import GreedySampler, run_cli, tiny_target

from dspec_cli.checkpoints import load_drafter
from dspec_cli.core import plugins
from dspec_cli.core.hardware import CostTable
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.workflows.step_profile import _Padded, profile_steps

GAMMA = 3
# drafter spec -> verified width of its diagonal (trees: 1 + nodes)
KINDS = {
    "prompt-lookup": GAMMA + 1,
    "draft-model": GAMMA + 1,
    "dflash": GAMMA + 1,
    "dspark-markov": GAMMA + 1,
    "dspark-rnn": GAMMA + 1,
    "eagle3": GAMMA + 1,
    "eagle3,tree=true,tree_top_k=2,tree_total_tokens=6": 6,
    "ddtree,tree_budget=5": 6,
    "ddtree,tree_budget=5,tree_mode=best": 6,
}


@pytest.mark.parametrize("spec", KINDS)
def test_every_drafter_profiles(spec):
    if spec.split(",")[0] not in plugins.registry().drafters:
        pytest.skip(f"{spec} is not installed")
    target = tiny_target("qwen3") if spec == "prompt-lookup" else None
    if target is None:  # the embedded defaults: trained drafters fit the embedded target
        from dspec_cli.runtime.target import Target

        target = Target.load(None, dtype="float32")
    drafter = load_drafter(spec, target, None, GAMMA)
    prof = profile_steps(target, drafter, requests=[1, 2], verify_tokens=[1, 2], contexts=[12], repeats=2, warmup=0)
    width = KINDS[spec]
    table = prof.cost_table()
    assert table.grid == [width, 2 * width] and table.measures == "step"
    assert all(s > 0 for s in table.measured["12"])
    widths = {v for (_, _, v) in prof.seconds}
    assert widths == ({width} if width != GAMMA + 1 else {1, 2, width})  # a tree has one width


def test_padding_keeps_greedy_decoding():
    """A padded drafter (filler drafts, one-hot q) decodes exactly what the target decodes greedily."""
    target = tiny_target("qwen3")
    drafter = load_drafter("prompt-lookup", target, None, GAMMA)
    prompts = [target.render_prompt("the quick brown fox"), target.render_prompt("tell me about the sea")]
    cfg = GenerationConfig(max_new_tokens=12, temperature=0.0, block_size=GAMMA, max_batch=2)
    plain = SpeculativeEngine(target, None, cfg, stop_ids=[]).generate(prompts)
    padded = SpeculativeEngine(target, _Padded(drafter, GAMMA), cfg, stop_ids=[]).generate(prompts)
    assert [r.output_ids for r in plain] == [r.output_ids for r in padded]
    state = drafter.init_state()
    drafter.add_requests(state, [torch.tensor(p) for p in prompts], None)
    p = _Padded(drafter, GAMMA).propose(state, torch.tensor([5, 6]), GAMMA, GreedySampler())
    assert p.lengths.tolist() == [GAMMA, GAMMA]


def test_cli_profiles_a_tree_drafter(tmp_path, capsys):
    out = tmp_path / "table.json"
    code, _, err = run_cli(["profile-hardware", "--drafter", "ddtree,tree_budget=5", "--block-size", str(GAMMA),
                            "--requests", "1", "--contexts", "8", "--repeats", "1", "--warmup", "0",
                            "--dtype", "float32", "--json", str(out)], capsys)
    assert code == 0, err
    table = CostTable.load(out)
    assert table.grid == [6] and table.row_tokens == 6 and json.loads(out.read_text())["measures"] == "step"


def test_additive_table_of_a_tree_drafter_is_refused(tmp_path, capsys):
    from tiny_models import assert_cli_error

    assert_cli_error(["profile-hardware", "--drafter", "ddtree,tree_budget=5", "--block-size", str(GAMMA),
                      "--requests", "1", "--contexts", "8", "--repeats", "1", "--warmup", "0", "--dtype", "float32",
                      "--format", "sglang-additive", "--json", str(tmp_path / "t.json")], capsys,
                     "a tree drafter verifies its whole tree (6 tokens per request) every step")

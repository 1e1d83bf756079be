"""Checkpoints remember their target: without --target, every command that takes a drafter
checkpoint loads the target recorded in it (and says so); a mismatch names that target."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import assert_cli_error, run_cli

from dspec_cli.core.files import DEFAULT_TARGET_PATH
from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.runtime.target import Target


@pytest.fixture(scope="module")
def ckpt(model_dir, tmp_path_factory):
    """A servable dflash checkpoint (γ = 3) for the local tiny target ``model_dir``, not the embedded one."""
    cls = get_drafter_class("dflash")
    torch.manual_seed(0)
    config = cls.config_class(block_size=3, num_layers=1, num_anchors=8, anchor_predicts=False)
    path = tmp_path_factory.mktemp("rec") / "ckpt"
    cls.build(config, Target.load(str(model_dir))).save_pretrained(path)
    return path


def _loaded_recorded(err: str, model_dir) -> None:
    lines = [ln for ln in err.splitlines() if "no --target" in ln]
    assert len(lines) == 1 and str(model_dir.resolve()) in lines[0], err


def test_commands_use_the_recorded_target(ckpt, model_dir, tmp_path, capsys):
    report = tmp_path / "bench.json"
    code, _, err = run_cli(["bench", "--drafter", "dflash", "--checkpoint", str(ckpt), "--num-prompts", "1",
                            "--max-new-tokens", "4", "--block-size", "3", "--json", str(report)], capsys)
    assert code == 0, err
    _loaded_recorded(err, model_dir)
    assert json.loads(report.read_text())["target"] == str(model_dir.resolve())

    code, out, err = run_cli(["export", str(ckpt), "--format", "vllm", "--output", str(tmp_path / "vllm")], capsys)
    assert code == 0, err
    _loaded_recorded(err, model_dir)
    assert f"vllm serve {model_dir.resolve()}" in out

    code, _, err = run_cli(["calibrate", "--drafter", "dflash", "--checkpoint", str(ckpt), "--num-prompts", "2",
                            "--max-new-tokens", "8", "--output", str(tmp_path / "cal"), "--force"], capsys)
    assert code == 0, err
    _loaded_recorded(err, model_dir)

    code, _, err = run_cli(["profile-hardware", "--drafter", "dflash", "--checkpoint", str(ckpt), "--block-size", "3",
                            "--requests", "1", "--contexts", "8", "--repeats", "1", "--warmup", "0",
                            "--json", str(tmp_path / "cost.json")], capsys)
    assert code == 0, err
    _loaded_recorded(err, model_dir)
    assert json.loads((tmp_path / "cost.json").read_text())["model"] == str(model_dir.resolve())


def test_a_mismatch_names_the_recorded_target(ckpt, model_dir, tmp_path, capsys):
    other = str(DEFAULT_TARGET_PATH)
    assert_cli_error(["bench", "--drafter", "dflash", "--checkpoint", str(ckpt), "--target", other,
                      "--num-prompts", "1", "--block-size", "3"], capsys,
                     f"(it was trained for {model_dir.resolve()}: pass --target {model_dir.resolve()})")
    assert_cli_error(["export", str(ckpt), "--format", "vllm", "--output", str(tmp_path / "o"), "--target", other],
                     capsys, "does not match the target's 256 (it was trained for")


def test_a_recorded_folder_that_is_gone(ckpt, tmp_path, capsys):
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in ckpt.iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    config = json.loads((moved / "config.json").read_text())
    config["target"]["name_or_path"] = str(tmp_path / "deleted-target")
    (moved / "config.json").write_text(json.dumps(config))
    assert_cli_error(["export", str(moved), "--format", "vllm", "--output", str(tmp_path / "o")], capsys,
                     "which no longer exists; pass --target PATH|HUB_ID")

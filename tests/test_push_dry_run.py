"""``dspec push --dry-run`` validates and lists what would be uploaded without touching the Hub;
a Hub id naming an empty repo says so."""

from __future__ import annotations

import json

import pytest
from test_hub import make_checkpoint
from tiny_models import assert_cli_error, run_cli

from dspec_cli.runtime.target import Target

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


@pytest.fixture
def ckpt(model_dir, tmp_path, capsys):
    path = make_checkpoint(tmp_path / "ckpt", Target.load(str(model_dir)))
    capsys.readouterr()
    return path


def test_dry_run_validates_and_lists_without_uploading(hub, ckpt, tmp_path, capsys):
    code, out, err = run_cli(["push", str(ckpt), "--repo-id", "alice/x", "--dry-run"], capsys)
    assert code == 0, err
    assert out.splitlines()[0].startswith("would commit 4 files") and "alice/x@main" in out
    for name in ("config.json", "model.safetensors", "calibration.json", "README.md"):
        assert name in out
    code, _, err = run_cli(["push", str(ckpt), "--repo-id", "alice/x", "--dry-run", "--private", "--json",
                            str(tmp_path / "plan.json")], capsys)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert code == 0 and plan["dry_run"] and plan["private"] and set(plan["files"]) >= {"config.json", "README.md"}
    (ckpt / "model.safetensors").unlink()
    assert_cli_error(["push", str(ckpt), "--repo-id", "alice/x", "--dry-run"], capsys, "model.safetensors is missing")
    assert not hub.repos and not hub.log  # nothing reached the Hub


def test_an_empty_hub_repo_says_so(hub, model_dir, capsys):
    from huggingface_hub import HfApi

    HfApi(endpoint=hub.url).create_repo("alice/empty")
    assert_cli_error(["bench", "--drafter", "dflash", "--checkpoint", "alice/empty", "--target", str(model_dir)],
                     capsys, "Hub repo alice/empty holds no files dspec reads")

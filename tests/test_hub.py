"""``dspec push`` and Hub ids everywhere, against a local Hub stand-in (tests/hub_server.py)."""

from __future__ import annotations

import json
import socket

import pytest
import torch
from tiny_models import assert_cli_error, run_cli

from dspec_cli.checkpoints.hub import resolve_checkpoint
from dspec_cli.core.calibration import Calibration
from dspec_cli.core.errors import DspecError
from dspec_cli.core.plugins import get_drafter_class
from dspec_cli.runtime.target import Target

REPO = "alice/tiny-dflash"
# huggingface_hub's LFS PUT passes a file as data=, which its HTTP client deprecates (not ours to fix)
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


@pytest.fixture
def ckpt(model_dir, tmp_path, capsys):
    """A checkpoint for the local tiny target ``model_dir``."""
    path = make_checkpoint(tmp_path / "ckpt", Target.load(str(model_dir)))
    capsys.readouterr()  # drop the loading output: CLI runs below read only their own
    return path


def make_checkpoint(path, target: Target):
    """A random 1-layer dflash drafter (γ = 3) for ``target``, saved with a calibration.json."""
    cls = get_drafter_class("dflash")
    torch.manual_seed(0)
    drafter = cls.build(cls.config_class(block_size=3, num_layers=1, num_anchors=8), target)
    drafter.save_pretrained(path)
    metrics = {"before": {"ece_mean": 0.2}, "after": {"ece_mean": 0.05}}
    Calibration.sts("dflash", 3, [1.5, 1.0, 0.8], "block", metrics).save(path)
    return path


def push(args, capsys):
    return run_cli(["push", *map(str, args)], capsys)


def test_push_then_load_by_hub_id_and_bench(hub, model_dir, tmp_path, capsys):
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.url)
    api.create_repo("alice/tiny-target")
    api.upload_folder(repo_id="alice/tiny-target", folder_path=model_dir)
    target = Target.load("alice/tiny-target")  # through the resolver: a Hub id -> cached snapshot
    ckpt = make_checkpoint(tmp_path / "ckpt", target)
    capsys.readouterr()
    config = json.loads((ckpt / "config.json").read_text())
    assert config["target"]["name_or_path"] == "alice/tiny-target"

    puts = hub.calls("lfs-put")
    code, out, err = push([ckpt, "--repo-id", REPO], capsys)
    assert code == 0, err
    assert out.strip() == f"{hub.url}/{REPO}"
    files = hub.files(REPO)
    assert sorted(files) == [".gitattributes", "README.md", "calibration.json", "config.json", "model.safetensors"]
    assert files["model.safetensors"] == (ckpt / "model.safetensors").read_bytes()
    assert hub.num_commits(REPO) == 1 and hub.calls("lfs-put") == puts + 1
    card = files["README.md"].decode()
    assert card == hub.validated[-1]
    assert "library_name: dspec" in card and "base_model: alice/tiny-target" in card
    assert "- speculative-decoding" in card and "- dflash" in card
    assert "- block: STS, mean ECE 0.200 before, 0.050 after" in card

    report = tmp_path / "bench.json"
    code, _, err = run_cli(["bench", "--drafter", "dflash", "--checkpoint", REPO, "--target", "alice/tiny-target",
                            "--num-prompts", "1", "--max-new-tokens", "4", "--block-size", "3", "--json", str(report)],
                           capsys)
    assert code == 0, err
    run = json.loads(report.read_text())["runs"][0]
    assert run["drafter"] == "dflash" and run["tau"] >= 1

    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True  # restored by the fixture's monkeypatch
    assert resolve_checkpoint(REPO) == resolve_checkpoint(f"{REPO}@main")
    with pytest.raises(DspecError, match="HF_HUB_OFFLINE is set and it is not in the local cache"):
        resolve_checkpoint("alice/never-downloaded")


def test_failed_upload_or_commit_commits_nothing_and_a_retry_succeeds(hub, ckpt, capsys):
    hub.fail("lfs-put", 500)
    assert_cli_error(["push", str(ckpt), "--repo-id", REPO], capsys, "HTTP 500")
    assert hub.num_commits(REPO) == 0
    assert hub.calls("lfs-put") == 6 and sum(hub.sleeps) <= 30  # bounded retries, not forever

    hub.heal()
    code, out, err = push([ckpt, "--repo-id", REPO], capsys)
    assert code == 0, err
    assert hub.num_commits(REPO) == 1

    (ckpt / "bench.json").write_text(json.dumps({"target": "t", "env": {}, "runs": [
        {"dataset": "builtin", "drafter": "dflash", "scheduler": "fixed", "concurrency": 1, "temperature": 1.0,
         "tau": 2.5, "speedup": 1.7}]}))
    hub.fail("commit", 500)
    assert_cli_error(["push", str(ckpt), "--repo-id", REPO], capsys, "nothing was committed")
    assert hub.num_commits(REPO) == 1 and "bench.json" not in hub.files(REPO)

    hub.heal()
    code, out, err = push([ckpt, "--repo-id", REPO, "--json", "-"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert hub.num_commits(REPO) == 2 and result["commit"] == hub.repos[REPO].branches["main"]
    assert "| builtin | dflash | fixed | 1 | 1 | 2.50 | 1.70x |" in hub.files(REPO)["README.md"].decode()


def test_push_to_a_branch_of_a_private_repo(hub, ckpt, capsys):
    (ckpt / "calibration.json").unlink()
    code, out, err = push([ckpt, "--repo-id", REPO, "--private", "--revision", "v1", "--endpoint", hub.url], capsys)
    assert code == 0, err
    assert out.strip() == f"{hub.url}/{REPO}/tree/v1"
    assert hub.repos[REPO].private and "config.json" in hub.files(REPO, "v1") and "config.json" not in hub.files(REPO)
    assert "No measurements yet" in hub.files(REPO, "v1")["README.md"].decode()


def test_bad_checkpoints_and_repo_ids(hub, ckpt, model_dir, tmp_path, capsys):
    for bad in ("not-a-repo", "a/b/c", "alice/x@"):
        assert_cli_error(["push", str(ckpt), "--repo-id", bad], capsys, "is not a Hub repo id of the form NS/NAME")
    assert_cli_error(["push", str(ckpt), "--repo-id", "alice/x@v1"], capsys, "give the branch with --revision")
    (tmp_path / "empty").mkdir()
    assert_cli_error(["push", str(tmp_path / "empty"), "--repo-id", REPO], capsys, "config.json is missing")
    assert_cli_error(["push", str(tmp_path / "nope"), "--repo-id", REPO], capsys, "nope: not found")
    weights = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    assert_cli_error(["push", str(ckpt), "--repo-id", REPO], capsys, "model.safetensors is corrupt")
    (ckpt / "model.safetensors").unlink()
    assert_cli_error(["push", str(ckpt), "--repo-id", REPO], capsys, "model.safetensors is missing")
    assert not hub.repos and not hub.log  # nothing reached the Hub

    assert_cli_error(["bench", "--drafter", "dflash", "--checkpoint", "nobody/missing", "--target", str(model_dir)],
                     capsys, "repo not found on http://127.0.0.1")
    assert_cli_error(["bench", "--drafter", "dflash", "--checkpoint", "missing-folder", "--target", str(model_dir)],
                     capsys, "no such file or folder, and not a Hub repo id (NS/NAME)")


def test_unreachable_endpoint_and_refused_token(hub, ckpt, model_dir, capsys, monkeypatch):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    assert_cli_error(["push", str(ckpt), "--repo-id", REPO, "--endpoint", closed], capsys, f"cannot reach {closed}")
    monkeypatch.setenv("HF_ENDPOINT", closed)
    assert_cli_error(["bench", "--drafter", "dflash", "--checkpoint", REPO, "--target", str(model_dir)], capsys,
                     "and it is not in the local cache")

    hub.token, hub.read_only_token = "hf_writer", "hf_reader"
    assert_cli_error(["push", str(ckpt), "--repo-id", REPO, "--endpoint", hub.url], capsys,
                     "HTTP 401: Invalid credentials in Authorization header); set HF_TOKEN or run `hf auth login`")
    code, out, err = push([ckpt, "--repo-id", REPO, "--endpoint", hub.url, "--token", "hf_reader"], capsys)
    assert code == 1 and "HTTP 403" in err and "hf auth login" in err and "hf_reader" not in out + err
    monkeypatch.setenv("HF_TOKEN", "hf_writer")
    code, _, err = push([ckpt, "--repo-id", REPO, "--endpoint", hub.url], capsys)
    assert code == 0, err

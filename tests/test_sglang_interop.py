"""SGLang DSpark's side files: STS / SPS schemas written and read (field names as SGLang's
dspark_sts.py / dspark_sps.py define them), tables moving both ways, STS collection shards,
whole-step profiling, and the shipped dspark exported for SGLang and vLLM."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from test_interop import GAMMA, build
from tiny_models import assert_cli_error, run_cli

from dspec_cli.core import sglang_sps
from dspec_cli.core.calibration import Calibration, RuleFit
from dspec_cli.core.errors import DspecError
from dspec_cli.core.hardware import CostTable
from dspec_cli.core.outputs import write_json
from dspec_cli.workflows import sglang_sts
from dspec_cli.workflows.calibrate import fit_sts

SHIPPED = Path(__file__).resolve().parents[1] / "dspec_cli" / "assets" / "drafters" / "dspark-markov"
# What SGLang reads, by name (dspark_sts.py DSparkStsCalibration, dspark_sps.py SpsCostTable /
# SpsAdditiveCostTable, models/dspark.py + dspark_config.py for config.json).
STS_KEYS = {"temperatures", "dataset", "num_samples", "ece_before", "ece_after"}
DIAGONAL_KEYS = {"sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"}
ADDITIVE_KEYS = {"bias_seconds", "bs_probes", "alpha_seconds", "m_probes", "theta_seconds"}
CONFIG_KEYS = ("block_size", "target_layer_ids", "num_target_layers", "mask_token_id", "markov_rank",
               "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
# numbers whose reciprocal does not round-trip in float64 (1 / (1 / 49) != 49)
DIAGONAL = {"sample_batch_tokens": [8, 16, 24, 48], "sample_steps_per_sec": [49.0, 41.3, 1 / 3 * 100, 12.7],
            "max_batch_tokens": 64}
ADDITIVE = {"bias_seconds": 0.004, "bs_probes": [1, 2, 4], "alpha_seconds": [0.0, 0.001, 0.003],
            "m_probes": [1, 8, 16, 32], "theta_seconds": [0.0, 0.002, 0.003, 0.007]}


def write(path: Path, obj: dict) -> Path:
    path.write_text(json.dumps(obj))
    return path


# -- STS ---------------------------------------------------------------------------------------


def test_sts_file_has_sglang_fields_and_reads_back(tmp_path):
    cal = Calibration.load(SHIPPED)
    sts = sglang_sts.sts_dict(cal, dataset="d", num_samples=12)
    assert set(sts) == STS_KEYS
    token = cal.fits["token"]  # SGLang's DSpark verifies token by token
    assert sts["temperatures"] == token.temperatures and sts["num_samples"] == 12
    assert len(sts["ece_before"]) == len(sts["ece_after"]) == cal.block_size
    assert sts["ece_after"] == token.metrics["sts"]["ece"]  # the ECE of what SGLang applies: the temperatures
    path = write_json(tmp_path / "sts.json", sts)
    back = Calibration.load(path, block_size=7)  # as calibration.json: one that records no rule, the token rule's
    assert back.fits["token"].temperatures == token.temperatures and not back.recorded_rule
    with pytest.raises(DspecError, match="is for block size 7, not 4"):
        Calibration.load(path, block_size=4)
    with pytest.raises(DspecError, match=r"temperatures\[1\]: should be greater than 0"):
        Calibration.load(write(tmp_path / "bad.json", {"temperatures": [1.0, 0.0]}))


def test_sts_with_a_position_nobody_verified_writes_no_ece(tmp_path):
    cal = Calibration.sts("dspark-markov", 2, [1.0, 2.0], "token",
                          {"before": {"ece": [0.1, None]}, "sts": {"ece": [0.1, None]}})
    sts = sglang_sts.sts_dict(cal)
    assert set(sts) == STS_KEYS and sts["ece_before"] == [] and sts["ece_after"] == []


def test_sts_file_needs_the_token_rule():
    """SGLang's DSpark verifies token by token: a calibration fitted only under the block rule is
    refused with the command that fits the token rule; with a token fit it is written."""
    block_only = Calibration.sts("dspark-markov", 2, [1.0, 2.0], "block", source="ckpt/calibration.json")
    with pytest.raises(DspecError, match=r"ckpt/calibration.json has no fit for the token rule, which SGLang's DSpark "
                                         r"verifies by \(only block\): fit it with `dspec calibrate --drafter "
                                         r"dspark-markov --checkpoint DIR --verify token --in-place`"):
        sglang_sts.sts_dict(block_only)
    both = block_only.with_fits({**block_only.fits, "token": RuleFit([1.5, 1.0])})
    assert sglang_sts.sts_dict(both)["temperatures"] == [1.5, 1.0]


# -- SPS tables ----------------------------------------------------------------------------------


def test_diagonal_table_round_trip_keeps_every_number(tmp_path):
    table = CostTable.load(write(tmp_path / "sps.json", DIAGONAL))
    assert table.measures == "step" and table.grid == DIAGONAL["sample_batch_tokens"]
    back = sglang_sps.to_sglang_diagonal(table)
    assert set(back) == DIAGONAL_KEYS and back == DIAGONAL
    # and through a dspec file in between
    table.save(tmp_path / "dspec.json")
    assert sglang_sps.to_sglang_diagonal(CostTable.load(tmp_path / "dspec.json")) == DIAGONAL


def test_dspec_table_to_diagonal_is_cleaned_and_context_averaged():
    table = CostTable(device="cpu", device_name="x", dtype="float32", model="m", torch="t", grid=[1, 2, 4],
                      contexts=[16, 64], measured={"16": [10.0, 12.0, 5.0], "64": [5.0, 4.0, 2.0]})
    out = sglang_sps.to_sglang_diagonal(table)
    assert set(out) == DIAGONAL_KEYS and out["sample_batch_tokens"] == [1, 2, 4] and out["max_batch_tokens"] == 4
    expect = 1.0 / table.step_time(torch.tensor([1.0, 2.0, 4.0]))
    assert out["sample_steps_per_sec"] == pytest.approx(expect.tolist())
    assert out["sample_steps_per_sec"] == sorted(out["sample_steps_per_sec"], reverse=True)  # monotone


def test_additive_table_reads_along_its_diagonal(tmp_path):
    path = write(tmp_path / "add.json", ADDITIVE)
    with pytest.raises(DspecError, match="needs the block size"):
        CostTable.load(path)
    table = CostTable.load(path, block_size=3)
    assert table.grid == [1, 4, 8, 16, 32]  # m probes and requests * (γ + 1)
    for b in table.grid:
        assert table.sps(b) == pytest.approx(1.0 / sglang_sps.additive_step_time(ADDITIVE, b / 4, b))


@pytest.mark.parametrize("change, message", [
    ({"sample_batch_tokens": [8, 8, 24, 48]}, "strictly increasing"),
    ({"sample_steps_per_sec": [1.0, 2.0]}, "one positive number per probe"),
    ({"max_batch_tokens": 10}, "max_batch_tokens must be an integer >="),
])
def test_diagonal_table_errors(tmp_path, change, message):
    with pytest.raises(DspecError, match=message):
        CostTable.load(write(tmp_path / "t.json", {**DIAGONAL, **change}))


def test_additive_table_errors(tmp_path):
    with pytest.raises(DspecError, match="bias_seconds: should be greater than 0"):
        CostTable.load(write(tmp_path / "t.json", {**ADDITIVE, "bias_seconds": 0}), block_size=3)
    with pytest.raises(DspecError, match="missing key"):
        CostTable.load(write(tmp_path / "u.json", {"bias_seconds": 1.0}), block_size=3)


def test_fit_additive_recovers_an_additive_model():
    """Cells made from a known table (theta exactly piecewise linear on the probes) fit back to it."""
    truth = {"bias_seconds": 0.01, "bs_probes": [1, 2, 4], "alpha_seconds": [0.0, 0.002, 0.005],
             "m_probes": [1, 5, 10, 20], "theta_seconds": [0.0, 0.001, 0.004, 0.006]}
    cells = [(r, r * v, sglang_sps.additive_step_time(truth, r, r * v)) for r in (1, 2, 4) for v in (1, 3, 5)]
    fit = sglang_sps.fit_additive(cells)
    assert set(fit) == ADDITIVE_KEYS and fit["bs_probes"] == truth["bs_probes"] and fit["m_probes"] == truth["m_probes"]
    for key in ("alpha_seconds", "theta_seconds"):
        assert fit[key] == pytest.approx(truth[key], abs=1e-12)
    assert fit["bias_seconds"] == pytest.approx(truth["bias_seconds"])
    with pytest.raises(DspecError, match="at least two --verify-tokens"):
        sglang_sps.fit_additive([(1, 5, 0.1), (2, 10, 0.2)])


# -- STS collection shards -------------------------------------------------------------------------


class NotATensor:
    """Pickled by reference: weights_only loading must refuse it."""


def shards(stem: Path, gamma: int = 5, sizes=(40, 30), seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for i, n in enumerate(sizes):
        logits = torch.randn(n, gamma, generator=gen) + 1.0
        count = torch.randint(0, gamma + 1, (n,), generator=gen)
        mask = (torch.arange(gamma)[None] < count[:, None]).float()
        torch.save({"logits": logits, "prefix_mask": mask}, f"{stem}.{i}.pt")


def test_shards_read_as_rounds(tmp_path):
    shards(tmp_path / "sts")
    rounds = sglang_sts.load_sts_shards(tmp_path / "sts", 5)
    assert len(rounds) == 70 and rounds.block_size == 5 and bool((rounds.verified == 5).all())
    first = torch.load(tmp_path / "sts.0.pt", weights_only=True)
    assert torch.equal(rounds.accepted[:40], first["prefix_mask"].sum(1).long())
    assert torch.allclose(rounds.confidence[:40], torch.sigmoid(first["logits"].double()))


@pytest.mark.parametrize("shard, message", [
    ({"logits": torch.zeros(3, 4), "prefix_mask": torch.zeros(3, 4)}, "γ = 4, expected 5"),
    ({"logits": torch.zeros(3, 5), "prefix_mask": torch.zeros(3, 4)}, "must both be [n, γ]"),
    ({"logits": torch.zeros(2, 5), "prefix_mask": torch.tensor([[1.0, 0, 1, 0, 0], [0.0] * 5])}, "1s followed by 0s"),
    ({"logits": torch.zeros(3, 5)}, "'logits' and 'prefix_mask'"),
    ({"logits": torch.zeros(3, 5), "prefix_mask": torch.zeros(3, 5), "x": NotATensor()}, "unreadable"),
])
def test_bad_shards_are_one_line_errors(tmp_path, capsys, shard, message):
    shards(tmp_path / "sts", sizes=(10,))
    torch.save(shard, tmp_path / "sts.1.pt")
    with pytest.raises(DspecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        sglang_sts.load_sts_shards(tmp_path / "sts", 5)
    assert_cli_error(["calibrate", "--drafter", "dspark", "--traces", str(tmp_path / "sts"), "--block-size", "5",
                      "--sglang-sts", str(tmp_path / "o.json")], capsys, "sts.1.pt")
    assert not (tmp_path / "o.json").exists()


def test_calibrate_from_shards_writes_both_files(tmp_path, capsys):
    shards(tmp_path / "sts", gamma=7)
    code, _, err = run_cli(["calibrate", "--drafter", "dspark", "--traces", str(tmp_path / "sts"),
                            "--output", str(tmp_path / "out"), "--sglang-sts", str(tmp_path / "sts.json")], capsys)
    assert code == 0, err
    temps = fit_sts(sglang_sts.load_sts_shards(tmp_path / "sts"))
    cal = Calibration.load(tmp_path / "out")
    assert cal.fits["token"].temperatures == temps  # SGLang's shards are token-rule rounds
    assert cal.fits["block"] == Calibration.load(SHIPPED).fits["block"]  # the checkpoint's other rule is kept
    sts = json.loads((tmp_path / "sts.json").read_text())
    assert set(sts) == STS_KEYS and sts["temperatures"] == temps and sts["num_samples"] == 70
    assert_cli_error(["calibrate", "--drafter", "dspark", "--traces", str(tmp_path / "nothing"),
                      "--sglang-sts", str(tmp_path / "x.json")], capsys, "nor STS shards")
    assert_cli_error(["calibrate", "--drafter", "dspark", "--traces", str(tmp_path / "sts"), "--dataset", "builtin",
                      "--output", str(tmp_path / "o2")], capsys, "not both")


# -- whole-step profile ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dspark_ckpt(model_dir, tmp_path_factory):
    from dspec_cli.runtime.target import Target

    folder = tmp_path_factory.mktemp("dspark")
    build("dspark-markov", Target.load(str(model_dir)), markov_rank=16).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("fmt, keys", [("dspec", None), ("sglang-diagonal", DIAGONAL_KEYS),
                                       ("sglang-additive", ADDITIVE_KEYS)])
def test_profile_whole_steps(model_dir, dspark_ckpt, tmp_path, capsys, fmt, keys):
    out = tmp_path / "table.json"
    code, _, err = run_cli(["profile-hardware", "--drafter", "dspark-markov", "--checkpoint", str(dspark_ckpt),
                            "--target", str(model_dir), "--block-size", str(GAMMA), "--requests", "1,2",
                            "--verify-tokens", f"1,{GAMMA + 1}", "--contexts", "8", "--repeats", "1",
                            "--warmup", "0", "--format", fmt, "--json", str(out)], capsys)
    assert code == 0, err
    raw = json.loads(out.read_text())
    if keys is not None:
        assert set(raw) == keys and sglang_sps.check_sps(raw, "t") == fmt.removeprefix("sglang-")
    table = CostTable.load(out, block_size=GAMMA)
    assert table.measures == "step" and table.block_size in (0, GAMMA)
    if fmt != "sglang-additive":
        assert table.grid == [GAMMA + 1, 2 * (GAMMA + 1)]  # R * (γ + 1): the diagonal


def test_forward_table_is_not_written_in_sglang_schema(model_dir, tmp_path, capsys):
    assert_cli_error(["profile-hardware", "--target", str(model_dir), "--format", "sglang-diagonal",
                      "--json", str(tmp_path / "t.json")], capsys, "needs --drafter")


def test_schedule_reads_an_sglang_table(tmp_path, capsys):
    from dspec_cli.workflows.calibrate import Rounds, save_traces

    rounds = Rounds.from_lists([[0.9, 0.5, 0.2]] * 8, [2] * 8, block_size=3)
    save_traces(tmp_path / "tr.jsonl", rounds, drafter="dspark-markov", block_size=3, verify="token")
    for table in (write(tmp_path / "d.json", DIAGONAL), write(tmp_path / "a.json", ADDITIVE)):
        code, _, err = run_cli(["schedule", "--cost-table", str(table), "--traces", str(tmp_path / "tr.jsonl"),
                                "--concurrency", "1,2", "--steps", "5", "--json", str(tmp_path / "r.json")], capsys)
        assert code == 0, err
        assert len(json.loads((tmp_path / "r.json").read_text())["results"]) == 2


# -- the shipped dspark, exported ----------------------------------------------------------------------


def test_shipped_dspark_for_sglang(tmp_path, capsys):
    sps = write(tmp_path / "sps.json", DIAGONAL)
    out = tmp_path / "sglang-export"
    code, stdout, err = run_cli(["export", str(SHIPPED), "--format", "sglang", "--output", str(out),
                                 "--cost-table", str(sps), "--json", str(tmp_path / "r.json")], capsys)
    assert code == 0, err
    argv = shlex.split(stdout.strip())
    sts_path, sps_path = str((out / "sglang" / sglang_sts.STS_FILE).resolve()), str((out / "sglang" / sglang_sps.SPS_FILE).resolve())
    assert argv[0] == "SGLANG_RAGGED_VERIFY_MODE=compact" and argv[1:4] == ["python", "-m", "sglang.launch_server"]
    flags = dict(zip(argv[4::2], argv[5::2], strict=False))
    assert flags["--speculative-algorithm"] == "DSPARK" and flags["--speculative-draft-model-path"] == str(out.resolve())
    assert flags["--speculative-dspark-block-size"] == "7"
    assert flags["--speculative-dspark-sps-table-path"] == sps_path
    assert flags["--speculative-dspark-confidence-sts-path"] == sts_path
    sts = json.loads(Path(sts_path).read_text())
    assert set(sts) == STS_KEYS and sts["temperatures"] == Calibration.load(SHIPPED).fits["token"].temperatures
    assert json.loads(Path(sps_path).read_text()) == DIAGONAL
    config = json.loads((out / "config.json").read_text())
    assert all(k in config for k in CONFIG_KEYS) and "speculators_model_type" not in config
    assert config["enable_confidence_head"] is True and config["markov_rank"] > 0
    assert config["markov_head_type"] == "vanilla" and config["block_size"] == 7
    assert stdout.strip() in (out / "SERVE.md").read_text()
    assert json.loads((tmp_path / "r.json").read_text())["files"] == {"sts": sts_path, "sps": sps_path}


def test_shipped_dspark_for_vllm(tmp_path, capsys):
    out = tmp_path / "vllm-export"
    code, stdout, err = run_cli(["export", str(SHIPPED), "--format", "vllm", "--output", str(out)], capsys)
    assert code == 0, err
    argv = shlex.split(stdout.strip())
    assert argv[:2] == ["vllm", "serve"] and argv[3] == "--speculative-config"
    assert json.loads(argv[4]) == {"method": "dspark", "model": str(out.resolve()), "num_speculative_tokens": 7,
                                   "enable_adaptive_verification": True}
    config = json.loads((out / "config.json").read_text())
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    assert not (out / "sglang").exists() and "calibrates at startup" in (out / "SERVE.md").read_text()


def test_export_refusals_the_engines_force(model_dir, tmp_path, capsys):
    from dspec_cli.runtime.target import Target

    target = Target.load(str(model_dir))
    build("dspark-markov", target, markov_rank=16, confidence_head=False).save_pretrained(tmp_path / "plain")
    assert_cli_error(["export", str(tmp_path / "plain"), "--format", "sglang", "--output", str(tmp_path / "o"),
                      "--target", str(model_dir)], capsys, "needs a trained confidence head")
    build("dspark-rnn", target, markov_rank=16).save_pretrained(tmp_path / "rnn")
    assert_cli_error(["export", str(tmp_path / "rnn"), "--format", "vllm", "--output", str(tmp_path / "o"),
                      "--target", str(model_dir)], capsys, "vanilla Markov head only")
    assert not (tmp_path / "o").exists()
    code, stdout, _ = run_cli(["export", str(tmp_path / "rnn"), "--format", "sglang", "--output",
                               str(tmp_path / "o"), "--target", str(model_dir)], capsys)  # SGLang has an RNN head
    assert code == 0 and "--speculative-algorithm DSPARK" in stdout
    assert json.loads((tmp_path / "o" / "config.json").read_text())["markov_head_type"] == "rnn"


def test_export_cost_table_of_another_block_size(model_dir, dspark_ckpt, tmp_path, capsys):
    table = CostTable(device="cpu", device_name="x", dtype="float32", model="m", torch="t", grid=[4, 8],
                      contexts=[8], measured={"8": [10.0, 8.0]}, measures="step", block_size=3)
    table.save(tmp_path / "t.json")
    assert_cli_error(["export", str(dspark_ckpt), "--format", "sglang", "--output", str(tmp_path / "o"),
                      "--target", str(model_dir), "--cost-table", str(tmp_path / "t.json")], capsys,
                     f"profiled at block size 3, this drafter's is {GAMMA}")
    assert not (tmp_path / "o").exists()


def test_cost_table_is_for_sglang_dspark_only(tmp_path, capsys):
    sps = write(tmp_path / "sps.json", DIAGONAL)
    assert_cli_error(["export", str(SHIPPED), "--format", "vllm", "--output", str(tmp_path / "o"),
                      "--cost-table", str(sps)], capsys, "used by SGLang's DSpark only")
    assert not (tmp_path / "o").exists()

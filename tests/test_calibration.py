"""Calibration metrics, Sequential Temperature Scaling, calibration.json, traces, the threshold
sweep, and ``dspec calibrate`` end to end on tiny models."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from tiny_models import assert_cli_error as _bad
from tiny_models import run_cli as run
from tiny_models import tiny_qwen3, tiny_tokenizer

from dspec_cli.core.calibration import Calibration, apply_temperatures
from dspec_cli.core.errors import DspecError
from dspec_cli.runtime.engine import RequestResult
from dspec_cli.workflows.calibrate import (
    Rounds,
    auroc,
    brier,
    calibrate,
    ece,
    fit_sts,
    load_traces,
    position_metrics,
    reliability,
    save_traces,
    threshold_sweep,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def synthetic(n: int, temps: list[float], seed: int = 0) -> tuple[Rounds, torch.Tensor]:
    """Rounds whose true conditional acceptance is c*; reported c = σ(logit(c*) / temps) (miscalibrated)."""
    g = _gen(seed)
    gamma = len(temps)
    true = 0.25 + 0.7 * torch.rand(n, gamma, generator=g, dtype=torch.float64)
    accepted = (torch.rand(n, gamma, generator=g, dtype=torch.float64) < true).long().cumprod(1).sum(1)
    reported = apply_temperatures(true, temps)
    return Rounds(reported, torch.full((n,), gamma), accepted), true


# --------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------


def test_ece_by_hand():
    pred = torch.tensor([0.12, 0.14, 0.91, 0.93, 0.97])
    label = torch.tensor([0, 1, 1, 1, 0])
    # bins: [0.10, 0.15) holds 2 (mean 0.13 vs 0.5), [0.90, 0.95) 2 (0.92 vs 1), [0.95, 1] 1 (0.97 vs 0)
    expected = (2 * 0.37 + 2 * 0.08 + 0.97) / 5
    assert ece(pred, label) == pytest.approx(expected)
    assert ece(torch.tensor([1.0, 0.0]), torch.tensor([1, 0])) == pytest.approx(0.0)  # edges stay in range


def test_auroc_matches_pair_counting_with_ties():
    g = _gen(1)
    pred = torch.randint(0, 6, (60,), generator=g).double() / 5  # many ties
    label = torch.rand(60, generator=g) < 0.4
    pos, neg = pred[label].tolist(), pred[~label].tolist()
    pairs = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p, q in itertools.product(pos, neg))
    assert auroc(pred, label) == pytest.approx(pairs / (len(pos) * len(neg)))
    assert auroc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])) is None
    assert brier(torch.tensor([0.5, 1.0]), torch.tensor([1, 1])) == pytest.approx(0.125)


def test_position_metrics_use_the_cumulative_product():
    rounds = Rounds.from_lists([[0.8, 0.5], [0.6], [0.9, 0.9]], [2, 0, 1], block_size=3)
    m = position_metrics(rounds)
    assert m["count"] == [3, 2, 0] and m["ece"][2] is None
    assert m["mean_pred"][1] == pytest.approx((0.4 + 0.81) / 2)  # Π c over rounds that verified position 2
    assert m["mean_label"] == [pytest.approx(2 / 3), pytest.approx(0.5), None]
    assert m["ece_mean"] == pytest.approx((3 * m["ece"][0] + 2 * m["ece"][1]) / 5)
    diagram = reliability(rounds)
    assert len(diagram) == 3 and sum(diagram[0]["count"]) == 3 and len(diagram[0]["edges"]) == 21


def test_rounds_validation():
    with pytest.raises(DspecError, match=r"record 1: confidence values must lie in \(0, 1\), got 1.0"):
        Rounds.from_lists([[0.5], [0.5, 1.0]], [0, 1])
    with pytest.raises(DspecError, match="confidence values must lie in"):
        Rounds.from_lists([[0.0]], [0])
    with pytest.raises(DspecError, match=r"accepted must be an integer in \[0, 1\]"):
        Rounds.from_lists([[0.5]], [2])
    with pytest.raises(DspecError, match="3 confidences for block size 2"):
        Rounds.from_lists([[0.5, 0.5, 0.5]], [0], block_size=2)


def test_rounds_from_engine_results():
    res = RequestResult(0, [1], verified=[2, 0, 1], accepted=[1, 0, 1], confidence=[[1.0, 0.3], [], [0.0]])
    rounds = Rounds.from_results([res], block_size=3)
    assert len(rounds) == 2 and rounds.verified.tolist() == [2, 1] and rounds.accepted.tolist() == [1, 1]
    assert 0 < float(rounds.confidence.min()) and float(rounds.confidence.max()) < 1  # clamped into (0, 1)


# --------------------------------------------------------------------------------------
# Sequential Temperature Scaling
# --------------------------------------------------------------------------------------


def test_sts_repairs_miscalibration():
    rounds, _ = synthetic(20_000, [0.5, 0.7, 1.0, 1.5])  # over- then under-confident
    fit = calibrate(rounds, "toy", "token", heldout=False).fits["token"]
    before, after = fit.metrics["before"], fit.metrics["sts"]
    assert after["ece_mean"] < before["ece_mean"] / 4
    assert all(a <= b + 1e-9 for a, b in zip(after["ece"], before["ece"], strict=True))
    assert fit.temperatures[0] == pytest.approx(2.0, rel=0.15)  # the inverse of the distortion
    assert after["auroc"][0] == pytest.approx(before["auroc"][0])  # order-preserving at position 1
    assert fit.metrics["after"]["ece_mean"] < before["ece_mean"] / 4  # the survival map repairs it too


def test_sts_keeps_calibrated_confidences():
    rounds, _ = synthetic(20_000, [1.0, 1.0, 1.0])
    temps = fit_sts(rounds)
    assert all(0.85 < t < 1.2 for t in temps), temps
    assert position_metrics(rounds.with_temperatures(temps))["ece_mean"] <= position_metrics(rounds)["ece_mean"] + 1e-9


def test_sts_fits_left_to_right():
    """Position 2 is fitted with position 1's temperature already applied."""
    rounds, _ = synthetic(5000, [0.6, 0.6], seed=3)
    temps = fit_sts(rounds)
    first = rounds.with_temperatures([temps[0], 1.0])
    assert fit_sts(first)[1] == pytest.approx(temps[1])
    unseen = Rounds.from_lists([[0.5]], [1], block_size=3)
    assert fit_sts(unseen)[1:] == [1.0, 1.0]  # nobody verified positions 2-3


# --------------------------------------------------------------------------------------
# calibration.json
# --------------------------------------------------------------------------------------


def test_calibration_file_roundtrip_and_checks(tmp_path):
    rounds, _ = synthetic(2000, [0.5, 1.0, 2.0])
    cal = calibrate(rounds, "dspark-markov", "block", chat_template_kwargs={"enable_thinking": True})
    file = cal.save(tmp_path)
    raw = json.loads(file.read_text())
    assert set(raw) == {"drafter", "block_size", "chat_template_kwargs", "rules"} and set(raw["rules"]) == {"block"}
    fit = raw["rules"]["block"]
    assert set(fit) == {"temperatures", "survival", "metrics"} and len(fit["survival"]["slope"]) == 3
    assert set(fit["metrics"]) == {"before", "sts", "after", "floor", "heldout"} and len(fit["metrics"]["after"]["ece"]) == 3
    back = Calibration.load(tmp_path, drafter="dspark-markov", block_size=3)
    assert back.fits["block"].temperatures == cal.fits["block"].temperatures and back.recorded_rule
    assert back.chat_template_kwargs == {"enable_thinking": True}
    conf = torch.tensor([[0.9, 0.8, 0.7]])
    assert torch.equal(back.apply(conf, "block"), cal.apply(conf, "block"))
    with pytest.raises(DspecError, match="is for drafter 'dspark-markov', not 'dflash'"):
        Calibration.load(file, drafter="dflash")
    with pytest.raises(DspecError, match="is for block size 3, not 7"):
        Calibration.load(file, block_size=7)
    (tmp_path / "legacy.json").write_text('{"temperatures": [1.5, 2.0]}')
    legacy = Calibration.load(tmp_path / "legacy.json", drafter="anything", block_size=2)
    assert legacy.rules == ["token"] and not legacy.recorded_rule  # older files: the token rule, said so
    assert "records no verification rule and is taken as the token rule's" in legacy.rule_warning("block")
    assert torch.allclose(legacy.apply(conf, "token"), apply_temperatures(conf, [1.5, 2.0, 1.0]))
    for text, message in (
        ('{"drafter": "x", "block_size": 2, "temperatures": [1.0, -1]}',
         r"temperatures\[1\]: should be greater than 0 \(got -1\)"),
        ('{"block_size": 2, "rules": {"greedy": {"temperatures": [1, 1]}}}',
         r"rules.greedy: should be 'token' or 'block' \(got 'greedy'\)"),
        ('{"block_size": 2, "rules": {"block": {"temperatures": [1, 1], "survival": {"slope": [1, -1], '
         '"offset": [0, 0]}}}}', r"rules.block.survival.slope\[1\]: should be greater than or equal to 0"),
        ('{"block_size": 2, "rules": {"block": {"temperatures": [1, 1], "survival": {"slope": [1]}}}}',
         "rules.block.survival.offset: missing"),
        ('{"block_size": 2, "rules": {"block": {"temperatures": [1, 1], "survival": {"slope": [1], "offset": [0]}}}}',
         "rules.block.survival.slope: 1 values for block size 2"),
        ('{"block_size": 2, "rules": {}}', "rules: dictionary should have at least 1 item"),
        ('{"rules": {"block": {"temperatures": [1, 1]}}}', "block_size: missing"),
    ):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(DspecError, match=message):
            Calibration.load(tmp_path / "bad.json")
    with pytest.raises(DspecError, match="not found"):
        Calibration.load(tmp_path / "missing.json")


def test_apply_temperatures():
    conf = torch.tensor([[0.9, 0.2], [0.5, 0.6]])
    out = apply_temperatures(conf, [2.0])
    assert torch.allclose(out[:, 1], conf[:, 1])  # past the list: T = 1
    assert torch.allclose(out[:, 0], torch.sigmoid(torch.logit(conf[:, 0]) / 2))
    assert torch.allclose(apply_temperatures(out, [0.5]), conf)  # reciprocal temperatures undo


# --------------------------------------------------------------------------------------
# Threshold sweep and traces
# --------------------------------------------------------------------------------------


def test_threshold_sweep():
    rounds = Rounds.from_lists([[0.9, 0.4, 0.8], [0.3, 0.9]], [3, 0], block_size=3)
    rows = {r["threshold"]: r for r in threshold_sweep(rounds, [0.0, 0.35, 0.5, 0.95])}
    assert rows[0.0]["verified_per_step"] == 2.5 and rows[0.0]["accepted_per_step"] == 1.5
    # t = 0.35: [0.9, 0.4, 0.8] is kept whole, [0.3, 0.9] is cut to nothing
    assert rows[0.35]["verified_per_step"] == 1.5 and rows[0.35]["rejected_per_step"] == 0.0
    assert rows[0.5]["accepted_per_step"] == 0.5 and rows[0.5]["acceptance_rate"] == 1.0
    assert rows[0.95]["verified_per_step"] == 0.0 and rows[0.95]["acceptance_rate"] is None
    informative, _ = synthetic(5000, [1.0] * 5)
    rates = [r["acceptance_rate"] for r in threshold_sweep(informative)]
    assert rates[-1] > rates[0] + 0.2  # pruning low-confidence suffixes raises the acceptance rate


def test_traces_roundtrip(tmp_path):
    rounds = Rounds.from_lists([[0.9, 0.4], [0.3]], [1, 0], block_size=3)
    path = tmp_path / "t.jsonl"
    save_traces(path, rounds, drafter="dspark", block_size=3, verify="block")
    back, meta = load_traces(path)
    assert meta == {"drafter": "dspark", "block_size": 3, "verify": "block"} and back.prompt is None
    assert torch.equal(back.confidence, rounds.confidence) and back.accepted.tolist() == [1, 0]
    named = Rounds.from_lists([[0.9], [0.3]], [1, 0], block_size=1, prompts=[4, 7])
    save_traces(path, named, drafter="dspark", block_size=1, verify="token")
    assert load_traces(path)[0].prompt.tolist() == [4, 7]
    line = '{{"drafter": "{}", "confidence": [0.5], "accepted": 0}}\n'
    path.write_text(line.format("a") + line.format("b"))
    with pytest.raises(DspecError, match="t.jsonl:2: drafter 'b' differs"):
        load_traces(path)
    line = '{{"verify": "{}", "confidence": [0.5], "accepted": 0}}\n'
    path.write_text(line.format("token") + line.format("block"))
    with pytest.raises(DspecError, match="t.jsonl:2: verify 'block' differs .* rules do not mix"):
        load_traces(path)
    path.write_text(line.format("tree"))
    with pytest.raises(DspecError, match="verify must be one of token, block"):
        load_traces(path)
    path.write_text('{"confidence": [0.5]}\n')
    with pytest.raises(DspecError, match="t.jsonl:1: expected"):
        load_traces(path)


# --------------------------------------------------------------------------------------
# dspec calibrate
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for name, seed in (("target", 0), ("draft", 1)):
        tiny_qwen3(seed).save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in
                               ("The quick brown fox", "def add(a, b):", "Numbers like 0 1 2", "User: What is")))
    return root






def _base(models, out):
    return ["calibrate", "--drafter", "draft-model", "--checkpoint", str(models / "draft"), "--target",
            str(models / "target"), "--dataset", str(models / "prompts.jsonl"), "--max-new-tokens", "24",
            "--block-size", "3", "--output", str(out)]


def test_calibrate_cli(models, tmp_path, capsys):
    out, report, plots, traces = tmp_path / "calibrated", tmp_path / "c.json", tmp_path / "plots", tmp_path / "t.jsonl"
    code, stdout, _ = run(_base(models, out) + ["--json", str(report), "--plots", str(plots), "--sweep-threshold",
                                                "--save-traces", str(traces)], capsys)
    assert code == 0 and "ECE raw" in stdout and "block rule" in stdout and "threshold sweep" in stdout
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()  # the checkpoint was copied
    cal = Calibration.load(out, drafter="draft-model", block_size=3)
    assert cal.rules == ["block"] and len(cal.fits["block"].slope) == 3  # the rule bench verifies by by default
    data = json.loads(report.read_text())
    assert set(data["rules"]) == {"block"} and data["kept_rules"] == [] and not data["evaluated"]
    fit = data["rules"]["block"]
    for key in ("ece_before", "ece_sts", "ece_after", "ece_heldout", "ece_sts_heldout", "temperatures", "survival",
                "num_rounds", "threshold_sweep", "ece_floor"):
        assert fit[key] is not None, key
    assert fit["heldout_split"] in ("5-fold over prompts", "5 contiguous blocks of rounds (prompts not recorded)")
    assert set(fit["before"]) >= {"ece", "auroc", "brier"} and len(fit["heldout"]["after"]["ece"]) == 3
    assert (plots / "reliability.png").stat().st_size > 1000 and (plots / "threshold_sweep.png").is_file()
    rounds, meta = load_traces(traces)
    assert meta == {"drafter": "draft-model", "block_size": 3, "verify": "block"} and len(rounds) == fit["num_rounds"]
    assert rounds.prompt is not None and set(rounds.prompt.tolist()) <= {0, 1, 2, 3}
    assert not (models / "draft" / "calibration.json").exists()  # the source checkpoint is untouched


def test_calibrate_cli_errors(models, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in (models / "draft").iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    args = _base(models, tmp_path / "out")
    args[args.index("--checkpoint") + 1] = str(ckpt)
    Calibration.sts("dspark-markov", 3, [1.0] * 3).save(ckpt)
    _bad(args, capsys, "is for drafter 'dspark-markov', not 'draft-model'")
    Calibration.sts("draft-model", 7, [1.0] * 7).save(ckpt)
    _bad(args, capsys, "is for block size 7, not 3")
    no_output = args[: args.index("--output")]
    _bad(no_output, capsys, f"give --output DIR for a calibrated copy of the checkpoint, or --in-place to rewrite {ckpt}")
    no_output[no_output.index("--checkpoint") + 1] = "some/hub-id"
    _bad(no_output, capsys, "give --output DIR")
    _bad(no_output + ["--in-place"], capsys, "--in-place needs a local --checkpoint folder")
    _bad(args[:-2] + ["--output", str(ckpt)], capsys, "pass --in-place to calibrate it in place")
    _bad(["calibrate", "--drafter", "prompt-lookup", "--output", str(tmp_path / "o")], capsys,
         "drafter 'prompt-lookup' has no confidence signal")
    _bad(args[:-2] + ["--num-prompts", "0"], capsys, "Invalid value for '--num-prompts'")
    _bad(args + ["--verify", "tree"], capsys, "--verify must be one of token, block, got 'tree'")
    _bad(args + ["--sglang-sts", str(tmp_path / "s.json")], capsys, "--sglang-sts writes the token rule's")
    _bad(args + ["--evaluate"], capsys, "--evaluate scores the checkpoint's calibration and writes none")


def test_calibrate_default_drafter_output_is_a_complete_checkpoint(tmp_path, capsys):
    from dspec_cli.core.plugins import get_drafter_class
    from dspec_cli.runtime.target import Target

    out = tmp_path / "calibrated"
    args = ["calibrate", "--drafter", "dspark", "--num-prompts", "4", "--max-new-tokens", "12", "--block-size", "3"]
    code, _, err = run(args + ["--output", str(out)], capsys)
    assert code == 1 and "rounds reached position" in err and "--force" in err and not out.exists()
    code, _, err = run(args + ["--output", str(out), "--force"], capsys)
    assert code == 0 and "Warning: only" in err, err
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "calibration.json"}
    drafter = get_drafter_class("dspark").from_pretrained(out, Target.load())  # loads as a checkpoint
    assert drafter.config.block_size == 3
    before = (out / "model.safetensors").read_bytes()
    code, _, err = run(args + ["--checkpoint", str(out), "--in-place", "--force"], capsys)
    assert code == 0, err
    assert Calibration.load(out, drafter="dspark-markov", block_size=3) and (out / "model.safetensors").read_bytes() == before


def test_calibrate_from_traces_with_plots(tmp_path, capsys):
    """--traces FILE --plots DIR: no target is loaded, the plots are titled by the traces."""
    rounds, _ = synthetic(400, [0.6, 0.8, 1.2], seed=5)
    traces, plots, sts = tmp_path / "t.jsonl", tmp_path / "plots", tmp_path / "sts.json"
    save_traces(traces, rounds, drafter="dspark-markov", block_size=3, verify="token")
    code, stdout, err = run(["calibrate", "--drafter", "dspark", "--traces", str(traces), "--plots", str(plots),
                             "--sweep-threshold", "--sglang-sts", str(sts)], capsys)
    assert code == 0, err
    assert (plots / "reliability.png").stat().st_size > 1000 and (plots / "threshold_sweep.png").is_file()
    assert json.loads(sts.read_text())["temperatures"] == fit_sts(rounds)
    assert "ECE raw" in stdout and "token rule" in stdout and f"wrote {plots / 'reliability.png'}" in err
    _bad(["calibrate", "--drafter", "dspark", "--traces", str(traces), "--verify", "block", "--sglang-sts",
          str(tmp_path / "b.json")], capsys, "were verified by the token rule; --verify block needs rounds verified by it")


def test_calibrate_takes_drafter_specs(tmp_path, capsys):
    """Drafter options (NAME,KEY=VALUE) as bench takes them; a wrapper without confidences is refused."""
    traces = tmp_path / "t.jsonl"
    save_traces(traces, synthetic(400, [1.0, 1.0], seed=6)[0], drafter="dspark-markov", block_size=2, verify="token")
    code, _, err = run(["calibrate", "--drafter", "dspark,markov_rank=8", "--traces", str(traces), "--sglang-sts",
                        str(tmp_path / "sts.json")], capsys)
    assert code == 0, err
    _bad(["calibrate", "--drafter", "dspark,no_such_key=1", "--traces", str(traces), "--sglang-sts",
          str(tmp_path / "x.json")], capsys, "unknown option(s) no_such_key")
    _bad(["calibrate", "--drafter", "ddtree:dspark,tree_budget=8", "--output", str(tmp_path / "o")], capsys,
         "drafter 'ddtree' has no confidence signal")


def test_calibrate_keeps_the_checkpoints_fit_for_the_other_rule(tmp_path, capsys):
    """A token-rule fit written into a checkpoint that has a block-rule fit keeps both; a file that
    records no rule is replaced, with a warning (its fit is not relabelled); --evaluate scores the
    file on other rounds and writes no calibration."""
    import shutil

    from dspec_cli.core.files import embedded_path

    ckpt = tmp_path / "ckpt"
    shutil.copytree(embedded_path("drafters") / "dspark-markov", ckpt)
    shipped = Calibration.load(ckpt)
    traces = tmp_path / "t.jsonl"
    save_traces(traces, synthetic(400, [0.6] * 7, seed=4)[0], drafter="dspark-markov", block_size=7, verify="token")
    code, stdout, err = run(["calibrate", "--drafter", "dspark", "--traces", str(traces), "--checkpoint", str(ckpt),
                             "--in-place", "--json", str(tmp_path / "r.json")], capsys)
    assert code == 0, err
    cal = Calibration.load(ckpt)
    assert cal.rules == ["token", "block"] and cal.fits["block"] == shipped.fits["block"]
    assert cal.fits["token"] != shipped.fits["token"] and "kept the earlier block rule fit" in stdout
    assert json.loads((tmp_path / "r.json").read_text())["kept_rules"] == ["block"]
    (ckpt / "calibration.json").write_text(json.dumps({"drafter": "dspark-markov", "temperatures": [1.0] * 7}))
    save_traces(traces, synthetic(400, [0.6] * 7, seed=4)[0], drafter="dspark-markov", block_size=7, verify="block")
    code, _, err = run(["calibrate", "--drafter", "dspark", "--traces", str(traces), "--checkpoint", str(ckpt),
                        "--in-place"], capsys)
    assert code == 0 and "records no verification rule: its fit is replaced" in err, err
    assert Calibration.load(ckpt).rules == ["block"]
    before = (ckpt / "calibration.json").read_text()
    code, stdout, err = run(["calibrate", "--drafter", "dspark", "--traces", str(traces), "--checkpoint", str(ckpt),
                             "--evaluate", "--json", str(tmp_path / "e.json")], capsys)
    assert code == 0 and "evaluated on these rounds" in stdout, err
    report = json.loads((tmp_path / "e.json").read_text())
    assert report["evaluated"] and report["rules"]["block"]["ece_heldout"] is None
    assert report["rules"]["block"]["ece_after"] is not None and (ckpt / "calibration.json").read_text() == before

"""``dspec bench`` end to end on a saved tiny model, and its one-line errors."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from tiny_models import assert_cli_error as _bad
from tiny_models import run_cli as run
from tiny_models import tiny_tokenizer
from transformers import AutoModelForCausalLM, Qwen3Config

from dspec_cli.core.hardware import CostTable
from dspec_cli.runtime.engine import GenerationConfig, RequestResult, RunStats
from dspec_cli.workflows.bench import verify_report


def test_bench_runs_and_writes_json(model_dir, tmp_path, capsys):
    report = tmp_path / "bench.json"
    code, out, _ = run(
        ["bench", "--target", str(model_dir), "--drafter", "prompt-lookup", "--drafter", "draft-model",
         "--checkpoint", "", "--checkpoint", str(model_dir), "--num-prompts", "2", "--max-new-tokens", "12",
         "--block-size", "3", "--json", str(report)],
        capsys,
    )
    assert code == 0
    assert "prompt-lookup" in out
    data = json.loads(report.read_text())
    runs = {r["drafter"]: r for r in data["runs"]}
    assert set(runs) == {"prompt-lookup", "draft-model"}
    for key in ("dataset", "tau", "cond_accept", "survival", "tokens_per_s", "baseline_tokens_per_s", "speedup",
                "num_prompts", "max_new_tokens", "temperature", "block_size"):
        assert key in runs["draft-model"]
    dm = runs["draft-model"]
    assert dm["tau"] == pytest.approx(1 + dm["mean_verified"])  # the target drafting for itself: all accepted
    assert dm["cond_accept"] == [1.0, 1.0, 1.0]
    assert data["env"]["torch"] == torch.__version__


@pytest.mark.parametrize("rules", [[], ["token"], ["block", "sampled"]])
def test_bench_records_the_verification_rule(model_dir, tmp_path, capsys, rules):
    report = tmp_path / "bench.json"
    code, out, _ = run(
        ["bench", "--target", str(model_dir), "--drafter", "draft-model", "--checkpoint", str(model_dir),
         "--num-prompts", "1", "--max-new-tokens", "8", "--block-size", "3", "--json", str(report),
         *[a for r in rules for a in ("--verify", r)]],
        capsys,
    )
    assert code == 0
    (dm,) = json.loads(report.read_text())["runs"]
    chain_rule = "token" if "token" in rules else "block"
    assert dm["verify"] == chain_rule and set(dm["verify_rounds"]) == {chain_rule} and "verify_note" not in dm
    assert chain_rule in out


def test_verify_report_notes_the_token_fallback():
    """Drafts without probabilities (prompt lookup) are verified token by token when block
    verification is asked for (the default): the report says so."""
    report = verify_report({"token": 5}, GenerationConfig())
    assert report["verify"] == "token" and "one-hot drafts" in report["verify_note"]
    assert "verify_note" not in verify_report({"token": 5}, GenerationConfig(chain_verify="token"))
    assert verify_report({}, GenerationConfig()) == {"verify": "-", "verify_rounds": {}}
    assert verify_report({"match": 1, "traversal": 9}, GenerationConfig())["verify"] == "traversal"


@pytest.mark.parametrize("rules,message", [(["tokens"], "--verify: unknown rule 'tokens'; chains: token, block"),
                                           (["token", "block"], "--verify: 'token' and 'block' are both rules")])
def test_bad_verify_rule(model_dir, capsys, rules, message):
    _bad(["bench", "--target", str(model_dir), "--drafter", "prompt-lookup", *[a for r in rules for a in ("--verify", r)]],
         capsys, message)


def test_progress_bar_starts_with_its_first_task_and_is_off_in_logs():
    import io

    from rich.console import Console

    from dspec_cli.cli.progress import CommandProgress

    for terminal in (True, False):
        buf = io.StringIO()
        with CommandProgress(Console(file=buf, force_terminal=terminal, width=80)):
            pass  # e.g. an input error before any work
        assert buf.getvalue() == ""
        with CommandProgress(Console(file=buf, force_terminal=terminal, width=80)) as bar:
            bar.advance(bar.add_task("work", total=2))
        assert (buf.getvalue() != "") == terminal


def test_unknown_drafter(model_dir, capsys):
    _bad(["bench", "--target", str(model_dir), "--drafter", "nope"], capsys, "unknown drafter 'nope'; known drafters:")


def test_dataset_line_without_turns(model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"turns": ["hi"]}\n{"text": "no turns"}\n')
    _bad(["bench", "--target", str(model_dir), "--drafter", "prompt-lookup", "--dataset", str(data)], capsys,
         f"{data}:2: line has no 'turns'")


def test_empty_prompt(model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"turns": [""]}\n')
    _bad(["bench", "--target", str(model_dir), "--drafter", "prompt-lookup", "--dataset", str(data)], capsys,
         "first turn is empty")


def test_prompt_longer_than_context(model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"turns": ["word " * 400]}) + "\n")
    _bad(["bench", "--target", str(model_dir), "--drafter", "prompt-lookup", "--dataset", str(data)], capsys,
         "1 of 1 prompt(s) do not fit the target's context of 256 tokens with --max-new-tokens 64")


def test_long_prompts_are_skipped_and_counted(model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"turns": ["word " * 400]}) + "\n" + json.dumps({"turns": ["hello there"]}) + "\n")
    args = ["bench", "--target", str(model_dir), "--drafter", "prompt-lookup", "--dataset", str(data),
            "--max-new-tokens", "4", "--block-size", "2"]
    code, out, err = run(args + ["--json", "-"], capsys)
    assert code == 0, err
    (run_,) = json.loads(out)["runs"]
    assert (run_["num_prompts"], run_["skipped_prompts"]) == (1, 1)
    assert "Warning: d: skipped 1 prompt(s)" in err
    _bad(args + ["--strict"], capsys, "1 of 2 prompt(s) do not fit")


def test_block_size_below_one(model_dir, capsys):
    _bad(["bench", "--target", str(model_dir), "--drafter", "prompt-lookup", "--block-size", "0"], capsys,
         "--block-size must be >= 1")


def test_vocabulary_mismatch(model_dir, tmp_path, capsys):
    other = tmp_path / "other"
    cfg = Qwen3Config(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    _bad(["bench", "--target", str(model_dir), "--drafter", "draft-model", "--checkpoint", str(other)], capsys,
         "draft model vocabulary (500) does not match the target's (384)")


def test_missing_dataset_file(model_dir, capsys):
    _bad(["bench", "--target", str(model_dir), "--drafter", "prompt-lookup", "--dataset", "nope.jsonl"], capsys,
         "dataset nope.jsonl: file not found")


def test_bench_schedulers_under_concurrency(model_dir, tmp_path, capsys):
    table = tmp_path / "cost.json"
    code, _, err = run(["profile-hardware", "--target", str(model_dir), "--grid", "1,2,4,8,16,32", "--contexts", "32",
                        "--repeats", "2", "--warmup", "1", "--json", str(table)], capsys)
    assert code == 0, err
    report = tmp_path / "bench.json"
    code, out, err = run(
        ["bench", "--target", str(model_dir), "--drafter", "draft-model", "--checkpoint", str(model_dir),
         "--scheduler", "fixed", "--scheduler", "hardware,probe_share=0.1", "--scheduler", "async,gate=false",
         "--cost-table", str(table), "--concurrency", "1,4", "--num-prompts", "4", "--max-new-tokens", "10",
         "--block-size", "3", "--repeats", "2", "--json", str(report), "--plots", str(tmp_path / "png")],
        capsys,
    )
    assert code == 0, err
    assert {p.name for p in (tmp_path / "png").iterdir()} == {"acceptance.png", "load.png"}
    runs = json.loads(report.read_text())["runs"]
    schedulers = ("fixed", "hardware,probe_share=0.1", "async,gate=false")
    assert {(r["scheduler"], r["concurrency"]) for r in runs} == {(s, c) for s in schedulers for c in (1, 4)}
    for r in runs:
        assert r["throughput_tokens_per_s"] > 0 and r["per_user_tokens_per_s"] > 0
        assert 1 <= r["mean_verify_budget"] <= 4
        assert r["repeats"] == 2 and len(r["tokens_per_s_runs"]) == 2 and len(r["baseline_tokens_per_s_runs"]) == 2
        assert len(r["speedup_runs"]) == 2 and min(r["speedup_runs"]) <= r["speedup"] <= max(r["speedup_runs"])
        assert 0 <= r["drafted_round_share"] <= 1


@pytest.mark.parametrize(
    "spec, message",
    [
        ("hardware,gates=false", "--scheduler 'hardware,gates=false': unknown option(s) gates; valid: gate, draft_seconds, probe_share"),
        ("hardware,probe_share=often", "--scheduler 'hardware,probe_share=often': probe_share expects float, got 'often'"),
        ("hardware,probe_share=0", "probe_share must be in (0, 1], got 0.0"),
        ("fastest", "unknown scheduler 'fastest'"),
    ],
)
def test_bad_scheduler_spec(model_dir, tmp_path, capsys, spec, message):
    table = tmp_path / "cost.json"
    run(["profile-hardware", "--target", str(model_dir), "--grid", "1,2", "--contexts", "8", "--repeats", "1",
         "--warmup", "0", "--json", str(table)], capsys)
    _bad(["bench", "--target", str(model_dir), "--drafter", "prompt-lookup", "--scheduler", spec,
          "--cost-table", str(table)], capsys, message)


def test_repeats_below_one(model_dir, capsys):
    _bad(["bench", "--target", str(model_dir), "--drafter", "prompt-lookup", "--repeats", "0"], capsys,
         "--repeats must be >= 1, got 0")


def test_hardware_scheduler_needs_cost_table(model_dir, capsys):
    _bad(["bench", "--target", str(model_dir), "--drafter", "prompt-lookup", "--scheduler", "hardware"], capsys,
         "--scheduler hardware needs --cost-table")


def test_concurrency_zero(model_dir, capsys):
    _bad(["bench", "--target", str(model_dir), "--drafter", "prompt-lookup", "--concurrency", "0"], capsys,
         "--concurrency values must be >= 1")



class _ClockEngine:
    """A stand-in engine: each run emits 10 tokens and advances a fake clock by its cost
    (3x during the machine's 'slow phase', the second repeat)."""

    def __init__(self, name: str, cost: float, log: list, now: list):
        self.name, self.cost, self.log, self.now = name, cost, log, now
        self.stats = RunStats()

    def generate(self, ids, on_finish=None):
        self.log.append(self.name)
        self.now[0] += self.cost * (3 if 4 <= len(self.log) <= 6 else 1)
        return [RequestResult(0, [1], output_ids=[2] * 10)]


def test_repeats_rotate_engine_order_and_speedup_is_paired(monkeypatch):
    """Repeat r starts at engine r mod n, and speedup is the median of per-repeat ratios, so a
    slow phase of the machine that hits one whole repeat does not move it."""
    import dspec_cli.workflows.bench as bench

    log, now = [], [0.0]
    engines = [(n, "-", _ClockEngine(n, c, log, now)) for n, c in (("base", 1.0), ("a", 0.5), ("b", 2.0))]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    timed = bench.run_interleaved(engines, [[1]], 3, 1, "builtin", None)
    assert log == ["base", "a", "b", "a", "b", "base", "b", "base", "a"]
    a = bench.run_metrics(timed[1], timed[0], RunStats(), 3)
    b = bench.run_metrics(timed[2], timed[0], RunStats(), 3)
    assert a["speedup_runs"] == pytest.approx([2.0, 2.0, 2.0]) and a["speedup"] == pytest.approx(2.0)
    assert b["speedup_runs"] == pytest.approx([0.5, 0.5, 0.5]) and len(b["drafted_round_share_runs"]) == 3
    assert a["tokens_per_s_runs"] == pytest.approx([20.0, 20 / 3, 20.0])
    assert bench.format_speedup(a) == "2.00x (2.00–2.00)"
    assert a["speedup_geomean"] == pytest.approx(2.0) and a["speedup_ci95"] == pytest.approx([2.0, 2.0])
    assert "speedup_ci95" not in bench.run_metrics(timed[1][:1], timed[0][:1], RunStats(), 3)


def test_speedup_bound_prices_verification_against_plain_steps():
    """τ · plain-step cost / verify-step cost: from the cost table where given, else measured."""
    import dspec_cli.workflows.bench as bench

    def reps(forward_seconds, rounds):
        return [([], 1.0, RunStats(forward_seconds=forward_seconds, verify_seconds=2 * forward_seconds, rounds=rounds))]

    measured = bench.speedup_bound(2.5, 8, 1, reps(3.0, 10), reps(1.0, 10))  # a verify forward costs 3 plain ones
    assert measured == {"speedup_bound": pytest.approx(2.5 / 3), "speedup_bound_source": "measured"}
    table = CostTable(device="cpu", device_name="x", dtype="float32", model="m", torch="t", grid=[1, 4, 8, 16],
                      contexts=[128], measured={"128": [100.0, 90.0, 50.0, 30.0]})
    tabled = bench.speedup_bound(2.5, 8, 1, reps(3.0, 10), reps(1.0, 10), table)
    assert tabled["speedup_bound"] == pytest.approx(2.5 * table.sps(8) / table.sps(1))
    assert tabled["speedup_bound_source"] == "cost_table"
    assert bench.speedup_bound(2.5, 8, 1, reps(0.0, 0), reps(1.0, 10))["speedup_bound"] is None
    phases = bench.phase_ms_per_round(RunStats(draft_seconds=0.2, verify_seconds=0.5, forward_seconds=0.3,
                                               accept_seconds=0.1, update_seconds=0.1, rounds=100))
    assert phases == pytest.approx({"draft": 2.0, "verify": 5.0, "forward": 3.0, "accept": 1.0, "update": 1.0,
                                    "prefill": 0.0, "other": 0.0})


def test_ratio_interval_is_a_t_interval_on_log_ratios():
    from dspec_cli.workflows.metrics import ratio_interval, t975

    mean, low, high = ratio_interval([math.exp(0.1), math.exp(-0.1)] * 2)
    half = 3.182 * statistics.stdev([0.1, -0.1] * 2) / 2  # t_0.975 with 3 degrees of freedom
    assert (mean, low, high) == pytest.approx((1.0, math.exp(-half), math.exp(half)))
    assert ratio_interval([1.3]) is None
    assert t975(100) == pytest.approx(1.984, abs=1e-3) and t975(30) == 2.042


def test_tables_show_the_drafted_share_of_every_repeat():
    import dspec_cli.workflows.bench as bench

    assert bench.drafted_share({"drafted_round_share": 0.0, "drafted_round_share_runs": [0.0, 0.3, 0.0]}) == pytest.approx(0.1)
    assert bench.drafted_share({"drafted_round_share": 0.25}) == 0.25  # reports from before the field

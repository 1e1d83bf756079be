"""``dspec bench`` end to end on a saved tiny model, and its one-line errors."""

from __future__ import annotations

import json
import math
import os

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
    assert dm["batch_invariant"] is False  # the default of eager rounds, where it costs (GenerationConfig.batch_invariance)
    assert data["env"]["torch"] == torch.__version__


def test_bench_records_batch_invariance_on(model_dir, tmp_path, capsys):
    report = tmp_path / "bench.json"
    code, _, _ = run(["bench", "--target", str(model_dir), "--drafter", "draft-model", "--checkpoint", str(model_dir),
                      "--num-prompts", "1", "--max-new-tokens", "8", "--block-size", "3", "--batch-invariant",
                      "--json", str(report)], capsys)
    assert code == 0
    (dm,) = json.loads(report.read_text())["runs"]
    assert dm["batch_invariant"] is True


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
         "Invalid value for '--block-size'")


def test_vocabulary_mismatch(model_dir, tmp_path, capsys):
    other = tmp_path / "other"
    cfg = Qwen3Config(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(other)
    tok = tiny_tokenizer()
    tok.add_tokens(["<|extra|>"])  # padded rows alone pair (tests/test_draft_model.py); another tokenizer does not
    tok.save_pretrained(other)
    capsys.readouterr()  # the saving's own output
    _bad(["bench", "--target", str(model_dir), "--drafter", "draft-model", "--checkpoint", str(other)], capsys,
         "draft model tokenizer differs from the target's tokenizer")


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
         "Invalid value for '--repeats'")


def test_hardware_scheduler_needs_cost_table(model_dir, capsys):
    _bad(["bench", "--target", str(model_dir), "--drafter", "prompt-lookup", "--scheduler", "hardware"], capsys,
         "--scheduler hardware needs --cost-table")


def test_concurrency_zero(model_dir, capsys):
    _bad(["bench", "--target", str(model_dir), "--drafter", "prompt-lookup", "--concurrency", "0"], capsys,
         "--concurrency values must be >= 1")



class _ClockEngine:
    """A stand-in engine: each run emits 10 tokens per prompt and advances a fake clock by its cost
    times the machine's load of the moment."""

    def __init__(self, name: str, cost: float, log: list, clock: dict):
        self.name, self.cost, self.log, self.clock = name, cost, log, clock
        self.stats = RunStats()

    def generate(self, ids, seeds, on_finish=None):
        self.log.append((self.name, seeds[0]))
        seconds = self.cost * self.clock["load"]()
        self.clock["now"] += seconds
        self.stats.forward_seconds = 0.5 * seconds
        return [RequestResult(0, p, output_ids=[2] * 10) for p in ids]


def test_runs_alternate_unit_by_unit_and_speedup_is_paired():
    """Every engine runs a unit of prompts before the next unit starts, in an order that rotates;
    speedup is the median of per-unit ratios, so a load that changes between units (but not within
    one) does not move it, while the unpaired tokens/s do move."""
    from dspec_cli.workflows import bench

    log, loads, reads = [], iter([1, 3, 2, 5]), [0]
    load = {"value": 1.0}
    clock = {"now": 0.0, "load": lambda: load["value"]}
    engines = [(n, "-", _ClockEngine(n, c, log, clock)) for n, c in (("base", 1.0), ("a", 0.5), ("b", 2.0))]

    def tick():  # read twice per run; a unit's first run draws the load, which holds for the unit
        if reads[0] % 6 == 0:
            load["value"] = next(loads)
        reads[0] += 1
        return clock["now"]

    units = bench.prompt_units([[1]] * 4, seed=0, rows=2)
    assert [seeds for _, seeds in units] == [[0, 1], [2, 3]]
    timed = bench.run_paired(engines, units, 2, clock=tick)
    assert log == [("base", 0), ("a", 0), ("b", 0), ("a", 2), ("b", 2), ("base", 2),
                   ("a", 0), ("b", 0), ("base", 0), ("b", 2), ("base", 2), ("a", 2)]
    a = bench.paired_metrics(timed[1], timed[0], 3)
    b = bench.paired_metrics(timed[2], timed[0], 3)
    assert a["speedup_runs"] == pytest.approx([2.0, 2.0]) and a["speedup"] == pytest.approx(2.0)
    assert b["speedup"] == pytest.approx(0.5) and a["pairs"] == 4 and len(b["drafted_round_share_runs"]) == 2
    assert a["tokens_per_s_runs"] == pytest.approx([40 / (0.5 * 1 + 0.5 * 3), 40 / (0.5 * 2 + 0.5 * 5)])
    assert a["speedup_bound"] == pytest.approx(4.0) and a["speedup_bound_source"] == "paired"  # forwards: half the time
    assert a["speedup_ci95"] is None and bench.format_speedup(a) == "2.00x"  # 4 pairs: too few for an interval
    assert bench.format_speedup({**a, "speedup_ci95": [1.5, 2.5]}) == "2.00x [1.50–2.50]"


def test_median_interval_is_the_order_statistic_interval():
    from scipy.stats import binom

    from dspec_cli.workflows.metrics import median_ci95

    assert median_ci95([1.0] * 5) is None  # 2 / 2^5 > 5 %: no distribution-free 95 % interval
    for n in (6, 10, 36, 72, 200):
        interval = median_ci95([float(i) for i in range(1, n + 1)])
        assert interval is not None
        low, high = interval
        k = int(low)
        assert high == n + 1 - k
        assert binom.cdf(k - 1, n, 0.5) <= 0.025 < binom.cdf(k, n, 0.5)  # the widest tail within 2.5 %


def test_bound_is_never_below_the_speedup_and_warnings_say_what_to_do():
    from dspec_cli.workflows import bench

    def timed(seconds, forward, tokens=10, prefill=0.0):
        return bench.Timed([RequestResult(0, [1], output_ids=[2] * tokens)], seconds,
                           RunStats(forward_seconds=forward, prefill_seconds=prefill, rounds=4))

    speedups, bounds = bench.paired_ratios([timed(1.0, 0.4), timed(2.0, 1.9), timed(1.0, 0.0)],
                                           [timed(2.0, 2.0), timed(3.0, 3.0), timed(1.0, 1.0)])
    assert speedups == pytest.approx([2.0, 1.5, 1.0]) and bounds == pytest.approx([5.0, 3 / 1.9 * 2 / 2, math.inf])
    assert all(b >= s for s, b in zip(speedups, bounds, strict=True))
    table = CostTable(device="cpu", device_name="x", dtype="float32", model="m", torch="t", grid=[1, 4, 8, 16],
                      contexts=[128], measured={"128": [100.0, 90.0, 50.0, 30.0]})
    assert bench.cost_table_bound(2.5, 8, 1, table) == pytest.approx(2.5 * table.sps(8) / table.sps(1))
    run = {"dataset": "gsm8k", "drafter": "dspark", "scheduler": "hardware", "concurrency": 1,
           "speedup": 2.2, "speedup_bound": 1.3, "speedup_bound_source": "cost_table",
           "speedup_runs": [1.2, 2.2], "speedup_runs_ci95": [[1.1, 1.3], [2.0, 2.4]]}
    over, disagree, drift = bench.run_warnings(run, (0.6, 100.0, 160.0))
    assert "speedup 2.20x exceeds its bound 1.30x" in over and "dspec profile-hardware" in over
    assert "repeats disagree" in disagree and "1.20x [1.10–1.30], 2.20x [2.00–2.40]" in disagree
    assert "moved by 60 %" in drift and "stop it and rerun" in drift
    assert bench.run_warnings({**run, "speedup": 1.2, "speedup_runs_ci95": [[1.1, 1.3], [1.2, 1.4]]}, (0.1, 1, 1)) == []
    one = {**run, "speedup_runs": [2.2], "speedup_runs_ci95": [[2.0, 2.4]]}
    assert bench.run_warnings({**one, "speedup": 1.35, "speedup_ci95": [1.25, 1.4]}, None) == []  # interval reaches the bound
    (over,) = bench.run_warnings({**one, "speedup": 1.45, "speedup_ci95": [1.35, 1.5]}, None)
    assert "exceeds its bound" in over
    assert bench.run_warnings({**one, "speedup": 1.4}, None) == []  # no interval: within BOUND_SLACK
    (over,) = bench.run_warnings({**one, "speedup": 1.5}, None)
    assert "exceeds its bound" in over
    (wide,) = bench.run_warnings({**one, "speedup": 1.2, "max_round_tokens": 512, "cost_table_max_tokens": 32}, None)
    assert "rounds verify up to 512 tokens, past the cost table's largest profiled B = 32" in wide
    assert "--max-batch-tokens 512" in wide
    assert bench.run_warnings({**one, "speedup": 1.2, "max_round_tokens": 32, "cost_table_max_tokens": 32}, None) == []
    (busy,) = bench.run_warnings({**run, "speedup": 1.2, "speedup_runs": [1.2], "speedup_runs_ci95": [[1.1, 1.3]], "other_cpu_cores": 1.1}, None)
    assert "other processes kept 1.1 CPU cores busy" in busy and "stop them and rerun" in busy
    assert bench.run_warnings({**run, "speedup": 1.2, "speedup_runs": [1.2], "speedup_runs_ci95": [[1.1, 1.3]], "other_cpu_cores": 0.3}, None) == []
    phases = bench.phase_ms_per_round(RunStats(draft_seconds=0.2, verify_seconds=0.5, forward_seconds=0.3,
                                               accept_seconds=0.1, update_seconds=0.1, rounds=100))
    assert phases == pytest.approx({"draft": 2.0, "verify": 5.0, "forward": 3.0, "accept": 1.0, "update": 1.0,
                                    "prefill": 0.0, "other": 0.0})
    base = [[timed(1.0, 1.0, prefill=0.1), timed(1.0, 1.0, prefill=0.1)], [timed(2.0, 2.0, prefill=0.2)] * 2]
    assert bench.baseline_drift(base) == pytest.approx((1.0, 5.0, 10.0))  # 9 decode tokens in 0.9 s, then 1.8 s


class _Meter:
    """A synthetic CpuMeter: other processes kept ``cores`` busy during every timed block."""

    def __init__(self, cores: float) -> None:
        self.other_cores = cores

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def test_cpu_meter_counts_what_others_used(tmp_path):
    from dspec_cli.core.cpu_load import CpuMeter, busy_seconds

    stat = tmp_path / "stat"
    line = "cpu  {} 0 {} 5000 10 0 0 {} 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
    stat.write_text(line.format(100, 50, 0))
    ticks = os.sysconf("SC_CLK_TCK")
    assert busy_seconds(stat) == pytest.approx(150 / ticks)
    with CpuMeter(stat) as meter:  # others: 20 s of user time and 5 s stolen, in a block of a few ms
        stat.write_text(line.format(100 + 20 * ticks, 50, 5 * ticks))
    assert meter.other_cores is not None and meter.other_cores > 100
    with CpuMeter(tmp_path / "missing") as meter:
        pass
    assert meter.other_cores is None


class _NoisyClock:
    """A synthetic machine: time passes only when the engine reads the clock (a fixed cost per
    read), scaled by the load of the moment. ``load(pair)`` draws a load per unit of prompts, so it
    holds while plain and speculative decoding of the same unit run, and changes between units."""

    def __init__(self, load):
        self.now, self.reads, self.load, self.factor = 0.0, 0, load, 1.0

    def engine(self) -> float:
        self.now += 1e-3 * self.factor
        return self.now

    def bench(self) -> float:  # read twice per run; a unit's first run starts every 4th read
        if self.reads % 4 == 0:
            self.factor = self.load(self.reads // 4)
        self.reads += 1
        return self.now


def test_noisy_timer_warns_and_the_paired_median_holds(model_dir, monkeypatch):
    """Through the real engine and a synthetic clock: a load that changes from prompt to prompt and
    doubles in the second repeat leaves the paired speedup where a quiet machine puts it, and
    the report warns that plain decoding's speed moved; the quiet run warns of nothing."""
    import random
    import types

    import dspec_cli.runtime.engine as engine_mod
    from dspec_cli.workflows.bench import BenchOptions, run_bench

    opts = BenchOptions(drafters=["draft-model"], checkpoints=[str(model_dir)], target=str(model_dir),
                        num_prompts=8, max_new_tokens=6, block_size=3, repeats=2, dtype="float32", warmup=False)
    rng = random.Random(0)
    reports = {}
    for name, load in {"quiet": lambda _: 1.0, "noisy": lambda unit: rng.uniform(1, 4) * (1 + (unit >= 8))}.items():
        clock = _NoisyClock(load)
        monkeypatch.setattr(engine_mod, "time", types.SimpleNamespace(perf_counter=clock.engine))
        others = 0.0 if name == "quiet" else 1.5
        (reports[name],) = run_bench(opts, clock=clock.bench, meter=lambda c=others: _Meter(c))["runs"]
    quiet, noisy = reports["quiet"], reports["noisy"]
    assert noisy["speedup"] == pytest.approx(quiet["speedup"]) and quiet["speedup_ci95"] is not None
    assert noisy["speedup_bound"] >= noisy["speedup"]
    slow, fast = sorted(noisy["baseline_tokens_per_s_runs"])
    assert slow < 0.7 * fast  # plain decoding ran at half speed in the second repeat
    assert quiet["warnings"] == [] and quiet["baseline_drift"] == pytest.approx(0.0, abs=1e-6)
    assert any("plain decoding's speed moved" in w for w in noisy["warnings"])
    assert noisy["other_cpu_cores"] == 1.5 and any("kept 1.5 CPU cores busy" in w for w in noisy["warnings"])


def test_tables_show_the_drafted_share_of_every_repeat():
    from dspec_cli.workflows import bench

    assert bench.drafted_share({"drafted_round_share": 0.0, "drafted_round_share_runs": [0.0, 0.3, 0.0]}) == pytest.approx(0.1)
    assert bench.drafted_share({"drafted_round_share": 0.25}) == 0.25  # reports from before the field

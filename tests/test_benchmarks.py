"""Every script under benchmarks/ runs, at tiny sizes on the embedded target, so a benchmark that
breaks fails here (their numbers are the scripts' business; trace_load: tests/test_trace_load.py;
budget, gpu.py's budgeted driver: tests/test_gpu_benchmark.py; vs_vllm without vLLM, and its
vllm_worker over a stand-in for vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import (
    batch_invariance,
    calibration_forms,
    drafter_latency,
    hf_assisted,
    table,
    verify,
    verify_rules,
    vllm_cpu,
    vllm_exports,
    vllm_worker,
    vs_vllm,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"__init__"}
SMOKED = {"drafter_latency", "hf_assisted", "table", "verify", "verify_rules", "trace_load", "gpu", "budget",
          "calibration_forms", "vs_vllm", "vllm_worker", "vllm_cpu", "vllm_exports", "batch_invariance"}


def test_every_benchmark_has_a_smoke_test():
    assert SCRIPTS == SMOKED, "a new script under benchmarks/ needs a smoke test here"


def test_drafter_latency(tmp_path):
    out = tmp_path / "latency.json"
    drafter_latency.main(["--shape", "tiny", "--blocks", "2", "--context", "16", "--device", "cpu", "--warmup", "0",
                          "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text())


def test_hf_assisted(tmp_path):
    out = tmp_path / "hf.json"
    hf_assisted.main(["--num-prompts", "1", "--max-new-tokens", "4", "--block-size", "2", "--json", str(out)])
    assert json.loads(out.read_text())


@pytest.mark.parametrize("report,flags", [("bench-default-quiet-epyc512.json", []),
                                          ("bench-load-cpu-epyc-zen4.json", ["--load"])])
def test_table(report, flags, capsys):
    table.main([str(ROOT / "docs" / "results" / report), *flags])
    assert capsys.readouterr().out.startswith("|")


def test_calibration_forms(tmp_path):
    """Every form fitted on one trace file and scored on another (synthetic rounds of one rule)."""
    import torch

    from dspec_cli.workflows.calibrate import Rounds, save_traces

    g = torch.Generator().manual_seed(0)
    for name in ("fit", "held"):
        true = 0.3 + 0.6 * torch.rand(400, 3, generator=g, dtype=torch.float64)
        accepted = (torch.rand(400, 3, generator=g, dtype=torch.float64) < true).long().cumprod(1).sum(1)
        rounds = Rounds(true.sqrt(), torch.full((400,), 3), accepted)  # overconfident raw confidences
        save_traces(tmp_path / f"{name}.jsonl", rounds, drafter="dspark-markov", block_size=3, verify="block")
    out = tmp_path / "forms.json"
    calibration_forms.main(["--fit", str(tmp_path / "fit.jsonl"), "--heldout", str(tmp_path / "held.jsonl"),
                            "--json", str(out)])
    (row,) = json.loads(out.read_text())
    assert row["verify"] == "block" and set(calibration_forms.FORMS) <= set(row) and row["floor"] > 0


def test_verify(tmp_path):
    out = tmp_path / "verify.json"
    verify.main(["--dry-run", "--backends", "torch", "--device", "cpu", "--warmup", "0", "--repeats", "1",
                 "--json", str(out)])
    assert json.loads(out.read_text())


def test_verify_rules_observes_the_engine(tmp_path):
    """Chains (dspark: token and block) and sampled trees (ddtree: sampled and traversal), each
    rule re-verifying the round's own drafts through the engine's ``observe`` hook."""
    out = tmp_path / "rules.json"
    verify_rules.main(["--drafter", "dspark", "--drafter", "ddtree:dspark", "--num-prompts", "1",
                       "--max-new-tokens", "6", "--samples", "2", "--json", str(out)])
    chain, tree = json.loads(out.read_text())["runs"]
    assert chain["rounds"] > 0 and set(chain["tau"]) == {"token", "block"}
    assert tree["rounds"] > 0 and set(tree["tau"]) == {"sampled", "traversal"}


def test_gpu_dry_run(tmp_path):
    """benchmarks/gpu.py on its CPU dry run (a two-layer toy target), its verification part (the
    engine's padded-grid verifiers; each part of the dry run takes 15 s to 3 min here)."""
    from benchmarks import gpu

    out = tmp_path / "gpu.json"
    gpu.main(["--small", "--device", "cpu", "--parts", "kernels", "--json", str(out)])
    report = json.loads(out.read_text())
    assert "kernels" in report and not report["errors"], report.get("errors")


def test_vs_vllm_without_vllm(tmp_path, monkeypatch):
    """dspec's side only (--no-vllm): plain and dspark, one interleaved repeat, the profile and
    the tables; ratios to vLLM are then absent."""
    monkeypatch.setattr(vs_vllm, "SETTLE_S", 0.0)
    out = tmp_path / "vs.json"
    vs_vllm.main(["--dataset", "builtin", "--num-prompts", "2", "--max-new-tokens", "6", "--concurrency", "1,2",
                  "--temperature", "0", "--drafter", "dspark", "--no-vllm", "--repeats", "1", "--profile",
                  "--json", str(out)])
    report = json.loads(out.read_text())
    assert {s["engine"] for s in report["summary"]} == {"dspec-plain", "dspec-dspark"}
    assert all(s["greedy_identical_to_dspec_plain"] == "2/2" for s in report["summary"])
    assert set(report["step_profile_ms_per_token"]) == {"dspec-plain T=0", "dspec-dspark T=0"}
    assert out.with_suffix(".md").read_text().startswith("CPU: ")


def test_batch_invariance(tmp_path, monkeypatch):
    """Both settings of plain and dspark, one repeat per cell, at T = 0 and 1: the paired ratio
    and, at T = 0, greedy identity per setting (the invariant one: every output plain's)."""
    monkeypatch.setattr(batch_invariance, "SETTLE_S", 0.0)
    out = tmp_path / "bi.json"
    batch_invariance.main(["--dataset", "builtin", "--num-prompts", "2", "--max-new-tokens", "6", "--concurrency", "1",
                           "--temperature", "0,1", "--drafter", "dspark", "--repeats", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert len(report["runs"]) == 2 * 2 * 2  # drafters x settings x temperatures
    dspark = {s["temperature"]: s for s in report["summary"] if s["drafter"] == "dspark"}
    assert dspark[0.0]["invariant_greedy_identical_to_plain"] == "2/2" and dspark[0.0]["fused_over_invariant"] > 0
    assert "invariant_greedy_identical_to_plain" not in dspark[1.0]
    assert out.with_suffix(".md").read_text().startswith("CPU: ")


class _FakeVllm:
    """The part of vLLM's API vllm_worker drives: LLM(...).generate and get_metrics, SamplingParams
    and TokensPrompt; each request's output is its prompt's first token repeated, and the counter
    counts generate calls (R = 1: one per prompt; R > 1: one for all)."""

    def __init__(self):
        self.started: dict = {}

    def LLM(self, **kwargs):  # noqa: N802 (vLLM's name)
        from types import SimpleNamespace as NS

        self.started = kwargs
        drafts = NS(name="vllm:spec_decode_num_drafts", value=0.0)

        def generate(prompts, params, use_tqdm=False):
            drafts.value += 1
            return [NS(outputs=[NS(token_ids=[p["prompt_token_ids"][0]] * params.max_tokens)]) for p in prompts]

        return NS(generate=generate, get_metrics=lambda: [drafts])


def test_vllm_worker_protocol(monkeypatch, capsys):
    """The worker's stdin/stdout protocol over a stand-in for vLLM (vLLM itself is not in the test
    environment): ready, one result per request (ids, seconds, speculative counters), a profile, quit."""
    import io
    import sys
    from types import SimpleNamespace as NS

    fake = _FakeVllm()
    monkeypatch.setitem(sys.modules, "vllm", NS(LLM=fake.LLM, SamplingParams=lambda **kw: NS(**kw)))
    monkeypatch.setitem(sys.modules, "vllm.inputs", NS(TokensPrompt=lambda **kw: kw))
    requests = [{"prompts": [[5, 6], [7]], "max_new_tokens": 3, "temperature": 0.0, "concurrency": 1},
                {"prompts": [[5, 6], [7]], "max_new_tokens": 2, "temperature": 1.0, "concurrency": 2},
                {"prompts": [[9]], "max_new_tokens": 4, "temperature": 0.0, "concurrency": 1, "profile": True},
                {"quit": True}, {"prompts": "never read"}]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(json.dumps(r) + "\n" for r in requests)))
    vllm_worker.main(["--target", "tiny", "--max-batch", "2", "--spec", '{"method": "ngram"}'])
    lines = [json.loads(line.removeprefix(vllm_worker.MARK)) for line in capsys.readouterr().out.splitlines()
             if line.startswith(vllm_worker.MARK)]
    ready, one, two, profile = lines
    assert ready == {"ready": True} and fake.started["speculative_config"] == {"method": "ngram"}
    assert one["token_ids"] == [[5, 5, 5], [7, 7, 7]] and one["spec"] == {"num_drafts": 2.0}
    assert two["token_ids"] == [[5, 5], [7, 7]] and two["spec"] == {"num_drafts": 1.0}
    assert profile["total"] > 0 and "host (Python, no operator running)" in profile


def test_vllm_cpu_without_vllm(tmp_path):
    """The parts of the vLLM launcher that need no vLLM: the CPU named, an export's serve command
    as the api_server's arguments, the server's environment (the engine tests start the servers)."""
    assert "vCPUs" in vllm_cpu.cpu_description()
    assert vllm_cpu.server_argv("vllm serve /t --speculative-config '{\"a\": 1}'") == [
        "--model", "/t", "--speculative-config", '{"a": 1}']
    with pytest.raises(ValueError, match="not a vLLM serve command"):
        vllm_cpu.server_argv("sglang serve /t")
    env = vllm_cpu.engine_env(tmp_path, {"X": "1"})
    assert env["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so") and env["X"] == "1" and "PYTHONPATH" not in env


def test_vllm_exports_without_vllm(tmp_path, capsys):
    """vllm_exports' options, pooled prompts and summary table, without starting vLLM (the timed run
    needs the engine environment: tests/test_engine_vllm.py covers the servers)."""
    with pytest.raises(SystemExit) as done:
        vllm_exports.main(["--help"])
    assert done.value.code == 0 and "--expand-fix" in capsys.readouterr().out
    prompts = vllm_exports.pooled_prompts(["builtin"], 2, tmp_path / "prompts.jsonl")
    assert len(prompts.read_text().splitlines()) == 2
    row = {"temperature": 0.0, "drafter": "dflash", "tokens_per_s": 20.0, "baseline_tokens_per_s": 10.0,
           "speedup": 2.0, "tau": 2.5, "num_prompts": 2, "max_new_tokens": 8, "concurrency": 1, "repeats": 1}
    table = vllm_exports.summary({"cpu": "a CPU", "env": {"torch": "2", "dtype": "float32"},
                                  "runs": [row, {**row, "engine": "vllm 0.32.0", "lossless": True}]})
    assert table.startswith("a CPU;") and "| 0 | vllm 0.32.0 | dflash | 20 | 10 | 2.00x | 2.50 | yes |" in table

"""``dspec bench --server URL --baseline-server URL`` against fake OpenAI-compatible servers (an
httpx transport that speaks the part of vLLM's API the bench reads, generating with the target
itself): the report, the losslessness check that flags a lossy engine, and the one-line errors.
The same command against a real vLLM is in tests/test_engine_vllm.py."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from tiny_models import assert_cli_error, run_cli

from dspec_cli.runtime.target import Target
from dspec_cli.workflows import bench_server
from dspec_cli.workflows.bench_server import lossless_check
from dspec_cli.workflows.served import SpecCounters, parse_metrics

SPEC, BASE = "http://spec.test:8000", "http://base.test:8001"

VLLM_METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} %(drafts)s
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} %(draft_tokens)s
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} %(accepted)s
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} %(pos0)s
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} %(pos1)s
"""
PLAIN_METRICS = "# HELP vllm:num_requests_running Requests.\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"


class FakeVllm:
    """One fake vLLM: /v1/models, /version, /metrics, /v1/completions (token-id prompts), generating
    with ``target``: greedy at T = 0, else sampled (``lossy``: uniformly random tokens instead).
    A speculating one counts 2 drafts of 2 tokens per request, 3 of them accepted."""

    def __init__(self, target: Target, speculating: bool, lossy: bool = False):
        self.target, self.speculating, self.lossy = target, speculating, lossy
        self.counts = dict(drafts=0, draft_tokens=0, accepted=0, pos0=0, pos1=0)
        self.metrics_status, self.probe_extra, self.wrong_model = 200, 0, False

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "owned_by": "vllm", "max_model_len": 2048}]})
        if path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if path == "/metrics":
            if self.metrics_status != 200:
                return httpx.Response(self.metrics_status, text="Not Found")
            return httpx.Response(200, text=VLLM_METRICS % self.counts if self.speculating else PLAIN_METRICS)
        body = json.loads(request.content)
        if isinstance(body["prompt"], str):  # the tokenizer probe
            count = len(self.target.tokenizer(body["prompt"])["input_ids"]) + self.probe_extra
            return httpx.Response(200, json={"choices": [{"text": "x"}], "usage": {"prompt_tokens": count}})
        tokens = self.generate(body["prompt"], body["max_tokens"], body.get("temperature", 1.0), body["seed"])
        if self.speculating:
            for key, n in dict(drafts=2, draft_tokens=4, accepted=3, pos0=2, pos1=1).items():
                self.counts[key] += n
        return httpx.Response(200, json={"choices": [{"text": "", "token_ids": tokens}]})

    @torch.no_grad()
    def generate(self, prompt: list[int], n: int, temperature: float, seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed + (7919 if self.speculating else 0))
        ids = list(prompt)
        for _ in range(n):
            logits = self.target.model(torch.tensor([ids])).logits[0, -1].float()
            if self.wrong_model:
                logits = -logits
            if self.lossy:
                tok = int(torch.randint(logits.numel(), (1,), generator=gen))
            elif temperature == 0:
                tok = int(logits.argmax())
            else:
                tok = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
            ids.append(tok)
        return ids[len(prompt):]


@pytest.fixture(scope="module")
def target(model_dir):
    return Target.load(str(model_dir), dtype="float32")


@pytest.fixture
def servers(target, monkeypatch):
    """The fake speculating and baseline servers behind ``bench --server``'s HTTP client."""
    spec, base = FakeVllm(target, True), FakeVllm(target, False)
    routes = {"spec.test": spec, "base.test": base}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host not in routes:
            raise httpx.ConnectError("Connection refused", request=request)
        return routes[request.url.host].handle(request)

    real = httpx.AsyncClient
    monkeypatch.setattr(bench_server.httpx, "AsyncClient",
                        lambda **kw: real(**{**kw, "transport": httpx.MockTransport(handler)}))
    return spec, base


def bench(model_dir, *extra: str) -> list[str]:
    return ["bench", "--server", SPEC, "--baseline-server", BASE, "--target", str(model_dir), "--num-prompts", "4",
            "--max-new-tokens", "8", *extra]


def test_served_engine_report(model_dir, servers, tmp_path, capsys):
    report = tmp_path / "bench.json"
    code, out, err = run_cli(bench(model_dir, "--temperature", "0", "--json", str(report)), capsys)
    assert code == 0, err
    (run,) = json.loads(report.read_text())["runs"]
    assert run["engine"] == "vllm 0.32.0" and run["server"] == SPEC and run["baseline_server"] == BASE
    assert run["tau"] == pytest.approx(1 + 3 / 2)  # the fake's counters: 3 accepted per 2 drafts
    assert run["cond_accept"] == [pytest.approx(1.0), pytest.approx(0.5)] and run["block_size"] == 2
    assert run["identical_share"] == 1.0 and run["lossless"] is True and run["loglik_delta"] == 0.0
    assert run["generated_tokens"] == 4 * 8 and run["pairs"] == 4 and run["speedup"] > 0
    assert set(run["latency_s"]) == {"mean", "p50", "p90"} and run["warnings"] == []
    assert "vllm 0.32.0" in out and "lossless" in out


def test_a_lossy_engine_is_flagged(model_dir, servers, tmp_path, capsys):
    servers[0].lossy = True
    report = tmp_path / "bench.json"
    code, _, err = run_cli(bench(model_dir, "--num-prompts", "8", "--max-new-tokens", "16", "--json", str(report)),
                           capsys)
    assert code == 0, err
    (run,) = json.loads(report.read_text())["runs"]
    assert run["lossless"] is False and run["loglik_delta"] < 0
    assert "NOT LOSSLESS" in err and any("NOT LOSSLESS" in w for w in run["warnings"])


def test_a_fair_sampler_passes(model_dir, servers, tmp_path, capsys):
    report = tmp_path / "bench.json"
    code, _, err = run_cli(bench(model_dir, "--num-prompts", "8", "--max-new-tokens", "16", "--json", str(report)),
                           capsys)
    assert code == 0, err
    (run,) = json.loads(report.read_text())["runs"]
    assert run["lossless"] is True, run


def test_unreachable_server(model_dir, servers, tmp_path, capsys):
    args = bench(model_dir, "--json", str(tmp_path / "r.json"))
    args[args.index(SPEC)] = "http://nowhere.test:1"
    assert_cli_error(args, capsys, "--server http://nowhere.test:1: unreachable")
    assert not (tmp_path / "r.json").exists()


def test_no_speculation_where_expected(model_dir, servers, capsys):
    servers[0].speculating = False
    assert_cli_error(bench(model_dir), capsys, "exposes no speculative-decoding metrics")


def test_missing_metrics_endpoint(model_dir, servers, capsys):
    servers[0].metrics_status = 404
    assert_cli_error(bench(model_dir), capsys, "no metrics endpoint (GET /metrics answered HTTP 404)")


def test_tokenizer_mismatch(model_dir, servers, capsys):
    servers[1].probe_extra = 3
    assert_cli_error(bench(model_dir), capsys, "--baseline-server http://base.test:8001 serves another tokenizer")


def test_baseline_serves_another_model(model_dir, servers, capsys):
    servers[1].wrong_model = True
    assert_cli_error(bench(model_dir), capsys, "serves another model than --target")


def test_baseline_that_speculates(model_dir, servers, capsys):
    servers[1].speculating = True
    assert_cli_error(bench(model_dir), capsys, "--baseline-server http://base.test:8001 speculates")


@pytest.mark.parametrize("args, message", [
    (["bench", "--server", SPEC], "--server needs --baseline-server"),
    (["bench", "--baseline-server", BASE], "give --server too"),
    (["bench"], "give --drafter"),
    (["bench", "--server", "spec.test", "--baseline-server", BASE], "expected an http:// or https:// URL"),
])
def test_option_errors(args, message, capsys):
    assert_cli_error(args, capsys, message)


def test_metrics_parsing_and_acceptance():
    counts = parse_metrics(VLLM_METRICS % dict(drafts=10, draft_tokens=70, accepted=15, pos0=8, pos1=4))
    before = parse_metrics(VLLM_METRICS % dict(drafts=2, draft_tokens=14, accepted=3, pos0=2, pos1=1))
    acc = (counts - before).acceptance()
    assert acc["tau"] == pytest.approx(1 + 12 / 8) and acc["rounds"] == 8
    assert acc["cond_accept"] == [pytest.approx(6 / 8), pytest.approx(3 / 6)]
    assert acc["survival"] == [pytest.approx(6 / 8), pytest.approx(3 / 8)]
    assert not parse_metrics(PLAIN_METRICS).speculating
    sglang = parse_metrics("# TYPE sglang:spec_accept_length gauge\nsglang:spec_accept_length{model_name=\"m\"} 2.5\n")
    assert sglang.speculating and (sglang - SpecCounters()).acceptance()["tau"] == 2.5
    with pytest.raises(ValueError, match="not Prometheus text"):
        parse_metrics("<html>{not metrics")


def test_lossless_check_has_power_and_no_false_alarm():
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(16, generator=gen) - 3.5).tolist()
    same = [b + 0.1 * float(torch.randn(1, generator=gen)) for b in base]
    assert lossless_check(same, base)["lossless"] is True
    assert lossless_check([b - 1.0 for b in same], base)["lossless"] is False
    assert lossless_check(same[:3], base[:3])["lossless"] is None  # too few pairs for a verdict

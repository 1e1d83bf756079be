"""Bad input, one table: every row must exit non-zero (usage errors: 2) with exactly one ``Error:
...`` line on stderr, no traceback, and no file created, changed or half-written. Rows run
in-process; most fail before any model loads."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from tiny_models import run_cli

from dspec_cli.core.files import ASSETS_DIR, embedded_path
from dspec_cli.core.hardware import CostTable


@dataclass
class Case:
    id: str
    args: str  # the command line; {d} = the folder of input files, {t} = an empty folder for outputs
    match: str  # in the one stderr line
    usage: bool = False  # a usage error (unknown option, wrong type): exit 2
    patch: dict = field(default_factory=dict)  # "module:attribute" -> replacement (interruptions, Hub)
    code: int | None = None  # the expected exit status (default: any non-zero)
    loads: bool = False  # reaches model loading (otherwise loading a model fails the row)
    hub: bool = False  # runs against the local Hub stand-in (the ``hub`` fixture)


def _no_model(*_args, **_kwargs):
    raise AssertionError("a model was loaded before the bad input was found")


def _interrupt(*_args, **_kwargs):
    raise KeyboardInterrupt


def _interrupted_training(opts, progress):
    from dspec_cli.training.loop import TrainResult

    return TrainResult(Path(opts.output or "runs/x"), 3, 10, False, {"loss": 1.0}, interrupted=True)


class _AsOnAGpu:
    """Stands in for LeanDecoder: the target runs transformers' forward, as on a GPU."""

    @staticmethod
    def unsupported(model) -> str:
        return "device cuda"


def _served(speculating: bool = True, metrics: int = 200, probe_tokens: int | None = None):
    """``run_server_bench`` against fake servers (an httpx transport): ``spec.test`` answers
    /v1/models, /version, /metrics (vLLM's spec-decode counters unless not ``speculating``, HTTP
    ``metrics`` otherwise) and counts the tokenizer probe as ``probe_tokens`` (None: no usage);
    ``base.test`` likewise without speculation; every other host is unreachable."""
    import functools

    import httpx

    from dspec_cli.workflows import bench_server

    def handler(request: httpx.Request) -> httpx.Response:
        spec = request.url.host == "spec.test"
        if request.url.host not in ("spec.test", "base.test"):
            raise httpx.ConnectError("Connection refused", request=request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "owned_by": "vllm"}]})
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if request.url.path == "/metrics":
            counters = "vllm:spec_decode_num_drafts_total 0.0\n" if spec and speculating else ""
            status = metrics if spec else 200
            return httpx.Response(status, text="# TYPE vllm:num_requests_running gauge\n"
                                               "vllm:num_requests_running 0.0\n" + counters)
        usage = {} if probe_tokens is None or spec else {"usage": {"prompt_tokens": probe_tokens}}
        return httpx.Response(200, json={"choices": [{"text": "x"}], **usage})

    return {"dspec_cli.workflows.bench_server:run_server_bench":
            functools.partial(bench_server.run_server_bench, transport=httpx.MockTransport(handler))}


REPO = Path(__file__).resolve().parents[1]
BENCH = "bench -d prompt-lookup --num-prompts 1 --max-new-tokens 4"
CAL = "calibrate -d dspark --num-prompts 1 --max-new-tokens 4"
SCHED = "schedule --cost-table {d}/cost.json --traces {d}/traces.jsonl"
SERVED = "bench --server http://spec.test:1 --baseline-server http://base.test:2 --num-prompts 1 --max-new-tokens 4"
REGEN = "data regenerate --dataset {d}/good.jsonl -o {t}/r.jsonl"
TRAIN = "train --recipe {r}/recipes/tiny/dspark-markov.toml"
PROC = "/proc/no/such"  # a path no process can create (not even root): writability is proven, not assumed

CASES = [
    # -- input files
    Case("dataset-missing", BENCH + " --dataset {d}/nope.jsonl", "dataset {d}/nope.jsonl: file not found"),
    Case("dataset-folder", BENCH + " --dataset {d}/folder", "is a folder, not a jsonl file"),
    Case("dataset-bad-json", BENCH + " --dataset {d}/bad_json.jsonl", "bad_json.jsonl:2: not valid JSON"),
    Case("dataset-bad-utf8", BENCH + " --dataset {d}/bad_utf8.jsonl", "bad_utf8.jsonl:2: not valid UTF-8"),
    Case("dataset-no-turns", BENCH + " --dataset {d}/no_turns.jsonl", "no_turns.jsonl:1: line has no 'turns'"),
    Case("dataset-not-object", BENCH + " --dataset {d}/list.jsonl", "list.jsonl:1: expected a JSON object"),
    Case("dataset-empty", BENCH + " --dataset {d}/empty.jsonl", "empty.jsonl: no prompts"),
    Case("dataset-bad-role", CAL + " --dataset {d}/bad_role.jsonl -o {t}/c", "conversations[0] has role 'robot'"),
    Case("dataset-empty-turn", BENCH + " --dataset {d}/empty_turn.jsonl", "the first turn is empty"),
    Case("cost-table-missing", BENCH + " -s hardware --cost-table {d}/nope.json", "nope.json"),
    Case("cost-table-bad-json", BENCH + " -s hardware --cost-table {d}/bad_json.jsonl", "not valid JSON"),
    Case("traces-missing", "schedule --cost-table {d}/cost.json --traces {d}/nope.jsonl", "file not found"),
    Case("traces-bad-line", "schedule --cost-table {d}/cost.json --traces {d}/no_turns.jsonl", "no_turns.jsonl:1: expected"),
    Case("calibration-missing", SCHED + " --calibration {d}/nope.json", "--calibration {d}/nope.json: file not found"),
    Case("recipe-missing", "train --recipe {d}/nope.toml -o {t}/run", "nope.toml"),
    Case("regenerate-output-is-input", "data regenerate --dataset {d}/good.jsonl -o {d}/good.jsonl",
         "--output {d}/good.jsonl: is --dataset {d}/good.jsonl, which this run reads", code=2),
    Case("dataset-lone-surrogate", BENCH + " --dataset {d}/surrogate.jsonl", "surrogate.jsonl:2: holds a lone surrogate \\ud800"),
    Case("calibrate-lone-surrogate", CAL + " -o {t}/c --dataset {d}/surrogate.jsonl", "surrogate.jsonl:2: holds a lone"),
    Case("regenerate-lone-surrogate", "data regenerate --dataset {d}/surrogate_conv.jsonl -o {t}/r.jsonl",
         "surrogate_conv.jsonl:1: holds a lone surrogate \\udc00"),
    Case("cost-table-binary", BENCH + " -s hardware --cost-table {d}/binary.bin", "--cost-table {d}/binary.bin: not a text file"),
    Case("cost-table-folder", BENCH + " -s hardware --cost-table {d}/folder", "--cost-table {d}/folder: is a folder"),
    Case("cost-table-not-a-table", BENCH + " -s hardware --cost-table {d}/object.json", "--cost-table {d}/object.json: device: missing"),
    Case("cost-table-bad-types", BENCH + " -s hardware --cost-table {d}/bad_grid.json", "--cost-table {d}/bad_grid.json: "),
    Case("schedule-cost-table-binary", "schedule --cost-table {d}/binary.bin --traces {d}/traces.jsonl", "--cost-table {d}/binary.bin: not a text file"),
    Case("calibration-binary", SCHED + " --calibration {d}/binary.bin", "--calibration {d}/binary.bin: not a text file"),
    Case("calibration-bad-json", SCHED + " --calibration {d}/bad_json.jsonl", "--calibration {d}/bad_json.jsonl: not valid JSON"),
    Case("calibration-not-calibration", SCHED + " --calibration {d}/object.json", "--calibration {d}/object.json: expected 'rules' (or an older file's 'temperatures')"),
    Case("traces-binary", "schedule --cost-table {d}/cost.json --traces {d}/binary.bin", "binary.bin:1: not valid UTF-8"),
    Case("recipe-binary", "train --recipe {d}/binary.bin -o {t}/run", "--recipe {d}/binary.bin: not a text file"),
    Case("recipe-bad-toml", "train --recipe {d}/bad.toml -o {t}/run", "--recipe {d}/bad.toml: not valid TOML"),
    Case("regenerate-recipe-binary", "data regenerate --recipe {d}/binary.bin", "--recipe {d}/binary.bin: not a text file"),
    Case("train-second-data-file", TRAIN + " -o {t}/run data.path=[\"{d}/good.jsonl\",\"{d}/nope.jsonl\"]",
         "nope.jsonl' (data.path) not found; create it with `dspec data regenerate --recipe"),
    Case("checkpoint-config-binary", "bench -d dspark --checkpoint {d}/ckpt_binary_config --num-prompts 1",
         "checkpoint {d}/ckpt_binary_config/config.json: not a text file", loads=True),
    # -- options
    Case("unknown-drafter", "bench -d nope", "unknown drafter 'nope'"),
    Case("unknown-drafter-option", "bench -d dspark,speed=2", "unknown option(s) speed"),
    Case("unknown-scheduler", BENCH + " -s fastest", "unknown scheduler 'fastest'"),
    Case("scheduler-needs-cost-table", BENCH + " -s hardware", "--scheduler hardware needs --cost-table"),
    Case("concurrency-zero", BENCH + " --concurrency 0", "--concurrency values must be >= 1"),
    Case("concurrency-not-a-list", BENCH + " --concurrency 1,x", "--concurrency must be a comma-separated list"),
    Case("temperature-negative", BENCH + " --temperature -1", "--temperature must be >= 0"),
    Case("top-p-zero", BENCH + " --top-p 0", "--top-p must be in (0, 1]"),
    Case("top-k-negative", BENCH + " --top-k -1", "Invalid value for '--top-k'", usage=True),
    Case("max-new-tokens-zero", "bench -d prompt-lookup --max-new-tokens 0", "Invalid value for '--max-new-tokens'", usage=True),
    Case("num-prompts-zero", "bench -d prompt-lookup --num-prompts 0", "Invalid value for '--num-prompts'", usage=True),
    Case("repeats-zero", BENCH + " --repeats 0", "Invalid value for '--repeats'", usage=True),
    Case("block-size-zero", BENCH + " --block-size 0", "Invalid value for '--block-size'", usage=True),
    Case("device-unknown", BENCH + " --device tpu9", "--device 'tpu9'"),
    Case("dtype-unknown", BENCH + " --dtype int8", "unknown dtype 'int8'"),
    Case("checkpoints-per-drafter", BENCH + " --checkpoint a --checkpoint b", "give one --checkpoint per --drafter"),
    Case("profile-contexts-zero", "profile-hardware --contexts 0,8", "--contexts values must be >= 1"),
    Case("profile-repeats-zero", "profile-hardware --repeats 0", "Invalid value for '--repeats'", usage=True),
    Case("profile-context-too-long", "profile-hardware --contexts 99999 --grid 1 --repeats 1", "exceeds the model's context", loads=True),
    Case("schedule-steps-zero", SCHED + " --steps 0", "Invalid value for '--steps'", usage=True),
    Case("schedule-layout", SCHED + " --layout ragged", "layout"),
    Case("export-format", "export {d}/folder --format tensorrt --output {t}/e", "--format must be one of"),
    Case("missing-required", "calibrate", "Missing option '--drafter'", usage=True),
    Case("bench-nothing-to-measure", "bench", "give --drafter (dspec's engine) or --server with --baseline-server"),
    Case("bench-server-unreachable", SERVED.replace("spec.test", "nowhere.test") + " --json {t}/r.json",
         "--server http://nowhere.test:1: unreachable", patch=_served(), loads=True),
    Case("bench-server-no-speculation", SERVED, "exposes no speculative-decoding metrics",
         patch=_served(speculating=False), loads=True),
    Case("bench-server-no-metrics", SERVED, "no metrics endpoint (GET /metrics answered HTTP 404)",
         patch=_served(metrics=404), loads=True),
    Case("bench-server-other-tokenizer", SERVED, "--baseline-server http://base.test:2 serves another tokenizer",
         patch=_served(probe_tokens=1), loads=True),
    Case("bench-server-without-baseline", "bench --server http://spec.test:1", "--server needs --baseline-server"),
    Case("bench-server-not-a-url", "bench --server spec.test --baseline-server http://base.test:2",
         "--server 'spec.test': expected an http:// or https:// URL"),
    Case("na-bench-server-model-without-server", BENCH + " --server-model m", "--server-model has no effect without --server"),
    Case("na-bench-server-with-scheduler", SERVED + " -s threshold", "--scheduler has no effect without --drafter"),
    Case("na-bench-server-batch-invariant", SERVED + " --no-batch-invariant",
         "--no-batch-invariant has no effect without --drafter"),
    Case("batch-invariant-transformers-forward", BENCH + " --batch-invariant",
         "batch-invariant verification needs dspec's own forward; this target runs transformers' forward "
         "(device cuda)", patch={"dspec_cli.runtime.target:LeanDecoder": _AsOnAGpu}, loads=True),
    Case("unknown-flag", "bench -d prompt-lookup --bogus", "No such option: --bogus", usage=True),
    Case("not-an-integer", "bench -d prompt-lookup --num-prompts many", "Invalid value for '--num-prompts'", usage=True),
    Case("unknown-command", "benchmark", "No such command 'benchmark'. Did you mean 'bench'? (see 'dspec -h')", usage=True),
    Case("unknown-subcommand", "data regen", "No such command 'regen'. Did you mean 'regenerate'? (see 'dspec data -h')", usage=True),
    Case("misspelt-drafter", "bench -d dsprak", "did you mean 'dspark'?"),
    Case("misspelt-scheduler", BENCH + " -s hardwar", "did you mean 'hardware'?"),
    # -- NaN and infinity: every float option refuses them (one parser), as do float spec options
    Case("temperature-nan", BENCH + " --temperature nan", "'--temperature': 'nan' is not a finite number", usage=True),
    Case("temperature-inf", BENCH + " --temperature inf", "'--temperature': 'inf' is not a finite number", usage=True),
    Case("top-p-nan", BENCH + " --top-p nan", "'--top-p': 'nan' is not a finite number", usage=True),
    Case("temperature-not-a-number", BENCH + " --temperature warm", "'warm' is not a number", usage=True),
    Case("calibrate-temperature-inf", CAL + " -o {t}/c --temperature inf", "'inf' is not a finite number", usage=True),
    Case("calibrate-top-p-minus-inf", CAL + " -o {t}/c --top-p -inf", "'-inf' is not a finite number", usage=True),
    Case("schedule-threshold-nan", SCHED + " --threshold nan", "'--threshold': 'nan' is not a finite number", usage=True),
    Case("regenerate-temperature-nan", REGEN + " --temperature NaN", "'NaN' is not a finite number", usage=True),
    Case("regenerate-top-p-inf", REGEN + " --top-p Infinity", "'Infinity' is not a finite number", usage=True),
    Case("regenerate-timeout-inf", REGEN + " --request-timeout inf", "'--request-timeout': 'inf' is not a finite number", usage=True),
    Case("scheduler-option-nan", BENCH + " -s hardware,probe_share=nan --cost-table {d}/cost.json",
         "probe_share must be a finite number, got 'nan'"),
    # -- output paths: refused before any model loads
    Case("json-parent-is-file", BENCH + " --json {d}/afile.txt/b.json", "afile.txt is a file, not a folder"),
    Case("json-is-folder", BENCH + " --json {d}/folder", "--json {d}/folder: is a folder"),
    Case("plots-is-file", BENCH + " --plots {d}/afile.txt", "--plots {d}/afile.txt: is a file"),
    Case("calibrate-no-output", CAL, "give --output DIR"),
    Case("calibrate-in-place-no-checkpoint", CAL + " --in-place", "--in-place needs a local --checkpoint folder"),
    Case("calibrate-output-not-empty", CAL + " -o {d}/folder", "folder is not empty; pass --overwrite"),
    Case("calibrate-traces-exist", CAL + " -o {t}/c --save-traces {d}/good.jsonl", "exists; pass --overwrite"),
    Case("calibrate-traces-per-rule-exist", CAL + " -o {t}/c --verify token --verify block --save-traces {d}/good.jsonl",
         "good-token.jsonl: exists; pass --overwrite"),
    Case("calibrate-two-rules-traces-stdout", CAL + " -o {t}/c --verify token --verify block --save-traces -",
         "--save-traces -: with several --verify rules each rule's rounds go to a file of their own"),
    Case("calibrate-verify-unknown", CAL + " -o {t}/c --verify tree", "--verify must be one of token, block, got 'tree'"),
    Case("calibrate-output-is-checkpoint", CAL + " --checkpoint {d}/ckpt_corrupt -o {d}/ckpt_corrupt", "pass --in-place",
         code=2),
    Case("calibrate-no-confidence", "calibrate -d prompt-lookup -o {t}/c", "has no confidence signal"),
    Case("json-is-socket", BENCH + " --json {d}/socket", "--json {d}/socket: is a socket; give a file path"),
    Case("export-output-not-empty", "export {d}/ckpt_corrupt --format vllm --output {d}/folder",
         "--output {d}/folder: folder is not empty; pass --overwrite"),
    Case("json-no-such-device", "drafters --json /dev/full", "cannot write /dev/full: No space left on device"),
    # -- checkpoints
    Case("checkpoint-missing", "bench -d dspark --checkpoint {d}/nope", "no such file or folder"),
    Case("checkpoint-no-config", "bench -d dspark --checkpoint {d}/folder --num-prompts 1", "config.json", loads=True),
    Case("checkpoint-corrupt-weights", "bench -d dspark --checkpoint {d}/ckpt_corrupt --num-prompts 1", "corrupt", loads=True),
    Case("block-beyond-trained", "bench -d dspark --block-size 99 --num-prompts 1", "exceeds the 7 positions drafter 'dspark-markov' was trained for", loads=True),
    Case("target-missing", BENCH + " --target {d}/nope", "cannot load target", loads=True),
    Case("prompt-too-long", BENCH + " --dataset {d}/long.jsonl", "do not fit the target's context", loads=True),
    # -- Hub
    Case("hub-bad-repo-id", "push {d}/ckpt_corrupt --repo-id not/a/repo", "not a Hub repo id"),
    Case("hub-revision-in-repo-id", "push {d}/ckpt_corrupt --repo-id alice/x@dev", "give the branch with --revision"),
    Case("hub-offline-not-cached", "bench -d dspark --checkpoint alice/never-downloaded", "HF_HUB_OFFLINE",
         patch={"huggingface_hub.constants:HF_HUB_OFFLINE": True}),
    Case("hub-repo-not-found", "bench -d dspark --checkpoint alice/missing", "cannot load checkpoint 'alice/missing': repo not found", hub=True),
    Case("hub-revision-not-found", "bench -d prompt-lookup --target alice/missing@v9", "cannot load target 'alice/missing@v9'", hub=True, loads=True),
    # -- interruption: "Interrupted", 130, nothing half-written
    Case("interrupt-bench", BENCH + " --json {t}/b.json", "Interrupted", code=130,
         patch={"dspec_cli.workflows.bench:warm_up": _interrupt}, loads=True),
    Case("interrupt-calibrate", CAL + " -o {t}/c --force", "Interrupted", code=130,
         patch={"dspec_cli.workflows.calibrate:collect_rounds": _interrupt}, loads=True),
    Case("interrupt-train", "train --recipe {d}/nope.toml -o {t}/run", "Interrupted", code=130,
         patch={"dspec_cli.training.loop:train": _interrupted_training}),
]
# -- an output that is an input, or two outputs that are one file: usage errors (2), before any work
READS, SAME, INSIDE = "which this run reads", "are the same file", "which this run writes whole"
EXPORT = "export {d}/ckpt_corrupt --format vllm"
CASES += [
    Case("out-json-is-checkpoint-config", EXPORT + " --output {t}/e --json {d}/ckpt_corrupt/config.json", READS, code=2),
    Case("out-json-is-checkpoint-weights", "profile-hardware -d dspark --checkpoint {d}/ckpt_corrupt "
         "--json {d}/ckpt_corrupt/model.safetensors", READS, code=2),
    Case("out-json-inside-export-output", EXPORT + " --output {t}/e --json {t}/e/report.json", INSIDE, code=2),
    Case("out-export-output-is-checkpoint", EXPORT + " --output {d}/ckpt_corrupt --overwrite", READS, code=2),
    Case("out-export-output-holds-checkpoint", EXPORT + " --output {d} --overwrite", "holds CHECKPOINT", code=2),
    Case("out-json-through-link-is-dataset", BENCH + " --dataset {d}/good.jsonl --json {d}/link_to_good", READS, code=2),
    Case("out-json-hard-link-to-dataset", BENCH + " --dataset {d}/good.jsonl --json {d}/hardlink_good", READS, code=2),
    Case("out-regenerate-output-through-link", "data regenerate --dataset {d}/good.jsonl -o {d}/link_to_good", READS, code=2),
    Case("out-regenerate-json-is-output", REGEN + " --json {t}/r.jsonl", SAME, code=2),
    Case("out-regenerate-recipe-output-is-recipe", "data regenerate --recipe {d}/self_output.toml",
         "data.path of --recipe {d}/self_output.toml", code=2),
    Case("out-save-traces-is-json", CAL + " -o {t}/c --json {t}/x.jsonl --save-traces {t}/x.jsonl", SAME, code=2),
    Case("out-two-streams-to-stdout", CAL + " -o {t}/c --json - --save-traces -", "both write to stdout", code=2),
    Case("out-calibrate-output-holds-dataset", CAL + " --dataset {d}/good.jsonl -o {d} --overwrite", "holds --dataset", code=2),
    Case("out-in-place-json-is-calibration", "calibrate -d dspark --in-place --checkpoint {d}/ckpt_corrupt "
         "--json {d}/ckpt_corrupt/calibration.json", "are the same file", code=2),
    Case("out-plots-same-as-json", BENCH + " --json {t}/p --plots {t}/p", SAME, code=2),
    Case("out-json-is-a-plot", BENCH + " --plots {t}/p --json {t}/p/acceptance.png", "this run also writes", code=2),
    Case("out-json-is-builtin-prompts", "drafters --json {a}/prompts.jsonl", "is the built-in prompts", code=2),
    Case("out-plots-in-embedded-target", BENCH + " --plots {a}/tiny-target", "the embedded target", code=2),
    Case("out-feature-cache-is-output", TRAIN + " -o {t}/run --feature-cache {t}/run", "are the same folder", code=2),
    Case("out-json-log-is-recipe", TRAIN + " -o {t}/run --json-log {r}/recipes/tiny/dspark-markov.toml", READS, code=2),
    Case("out-schedule-json-is-traces", SCHED + " --json {d}/traces.jsonl", READS, code=2),
    Case("out-push-json-is-card", "push {d}/ckpt_corrupt --repo-id alice/x --json {d}/ckpt_corrupt/README.md", READS,
         code=2),
    # -- special files and links: written through or refused, never replaced or probed
    Case("out-json-link-loop", BENCH + " --json {d}/loop", "--json {d}/loop: Too many levels of symbolic links"),
    Case("out-plots-is-dev-null", BENCH + " --plots /dev/null", "is a character device, not a folder"),
    Case("out-export-output-is-fifo", EXPORT + " --output {d}/fifo", "--output {d}/fifo: is a FIFO, not a folder"),
    Case("out-folder-is-stdout", BENCH + " --plots -", "stdout cannot hold a folder"),
    Case("out-regenerate-to-dev-full", REGEN.replace("-o {t}/r.jsonl", "-o /dev/full") + " --max-new-tokens 2",
         "cannot write /dev/full: No space left on device", loads=True),
    # -- JSON and TOML read as the standards have them: no NaN, no overflow, no lone surrogate, bounded depth
    Case("rec-cost-table-nan", BENCH + " -s hardware --cost-table {d}/cost_nan.json", "NaN is not a JSON number"),
    Case("rec-cost-table-overflow", BENCH + " -s hardware --cost-table {d}/cost_overflow.json", "inf is not a finite number"),
    Case("rec-cost-table-huge-int", BENCH + " -s hardware --cost-table {d}/cost_bigint.json", "out of range"),
    Case("rec-cost-table-bool-grid", BENCH + " -s hardware --cost-table {d}/cost_bool.json", "grid[0]: should be a valid integer"),
    Case("rec-cost-table-unsorted", SCHED.replace("{d}/cost.json", "{d}/cost_unsorted.json"), "grid must be strictly increasing"),
    Case("rec-cost-table-deep", BENCH + " -s hardware --cost-table {d}/deep.json", "nested deeper than 32 levels"),
    Case("rec-sglang-sps-string-probes", BENCH + " -s hardware --cost-table {d}/sps_strings.json",
         "sample_batch_tokens[0]: should be a valid integer"),
    Case("rec-calibration-nan", SCHED + " --calibration {d}/cal_nan.json", "NaN is not a JSON number"),
    Case("rec-calibration-string-block", SCHED + " --calibration {d}/cal_string_block.json", "block_size: should be a valid integer"),
    Case("rec-calibration-reserved-kwargs", SCHED + " --calibration {d}/cal_reserved.json", "tokenize is a name the chat-template call sets"),
    Case("rec-calibration-surrogate", SCHED + " --calibration {d}/cal_surrogate.json", "holds a lone surrogate \\udfff at drafter"),
    Case("rec-traces-nan", "schedule --cost-table {d}/cost.json --traces {d}/traces_nan.jsonl", "traces_nan.jsonl:1: NaN is not"),
    Case("rec-dataset-deep-line", BENCH + " --dataset {d}/deep.jsonl", "deep.jsonl:1: nested deeper than 32 levels"),
    Case("rec-dataset-infinity", BENCH + " --dataset {d}/inf.jsonl", "inf.jsonl:1: Infinity is not a JSON number"),
    Case("rec-kwargs-nan", BENCH + " --chat-template-kwargs {{\"a\":NaN}}", "--chat-template-kwargs: NaN is not a JSON number"),
    Case("rec-kwargs-surrogate", BENCH + " --chat-template-kwargs {{\"a\":\"\\ud800\"}}", "holds a lone surrogate \\ud800 at a"),
    Case("rec-kwargs-deep", BENCH + " --chat-template-kwargs " + "[" * 200 + "]" * 200, "nested deeper than 32 levels"),
    Case("rec-kwargs-huge-int", BENCH + " --chat-template-kwargs {{\"a\":1" + "0" * 30 + "}}", "out of range"),
    Case("rec-kwargs-reserved-tokenize", BENCH + " --chat-template-kwargs {{\"tokenize\":false}}",
         "--chat-template-kwargs: tokenize is a name the chat-template call sets itself"),
    Case("rec-kwargs-reserved-messages", "data regenerate --dataset {d}/good.jsonl -o {t}/r.jsonl "
         "--chat-template-kwargs {{\"messages\":[]}}", "messages is a name the chat-template call sets itself"),
    Case("rec-kwargs-duplicate-key", BENCH + " --chat-template-kwargs {{\"enable_thinking\":true,\"enable_thinking\":false}}",
         "key 'enable_thinking' appears twice"),
    Case("rec-dataset-huge-int", BENCH + " --dataset {d}/bigint.jsonl", "bigint.jsonl:1: id: integer"),
    Case("rec-cost-table-negative-context", SCHED.replace("{d}/cost.json", "{d}/cost_negctx.json"),
         "contexts[0]: should be greater than or equal to 0"),
    Case("rec-calibration-no-temperatures", SCHED + " --calibration {d}/cal_empty.json", "temperatures: list should have at least 1"),
    Case("rec-calibration-zero-temperature", SCHED + " --calibration {d}/cal_zero.json", "temperatures[0]: should be greater than 0"),
    Case("out-json-is-cost-table", BENCH + " -s hardware --cost-table {d}/cost.json --json {d}/cost.json", READS, code=2),
    Case("out-json-is-dataset-via-dotdot", BENCH + " --dataset {d}/good.jsonl --json {d}/folder/../good.jsonl", READS,
         code=2),
    Case("int-top-k-huge", BENCH + " --top-k 99999999999", "Invalid value for '--top-k'", usage=True),
    Case("int-profile-repeats-huge", "profile-hardware --repeats 99999999", "Invalid value for '--repeats'", usage=True),
    Case("rec-kwargs-not-object", CAL + " -o {t}/c --chat-template-kwargs [1]", "must be a JSON object"),
    Case("rec-recipe-nan", "train --recipe {d}/recipe_nan.toml -o {t}/run", "train.lr: should be a finite number"),
    Case("rec-recipe-date-in-template", "train --recipe {d}/recipe_date.toml -o {t}/run", "a date is not a JSON value"),
    Case("rec-recipe-deep-template", "train --recipe {d}/recipe_deep.toml -o {t}/run", "nested deeper than 32 levels"),
    Case("rec-recipe-regenerate-range", "data regenerate --recipe {d}/recipe_regen0.toml",
         "recipe_regen0.toml: regenerate.max_new_tokens: should be greater than or equal to 1"),
    Case("rec-override-names-the-override", TRAIN + " -o {t}/run train.warmup_ratio=1.5",
         "override 'train.warmup_ratio=1.5': should be less than 1"),
    Case("rec-override-drafter-inf", TRAIN + " -o {t}/run drafter.loss_decay_gamma=inf",
         "override 'drafter.loss_decay_gamma=inf': inf is not a finite number"),
    # -- integer options have ranges: usage errors before anything loads, naming the option
    Case("int-seed-too-big", BENCH + " --seed 18446744073709551616", "Invalid value for '--seed'", usage=True),
    Case("int-seed-negative", REGEN + " --seed -3", "Invalid value for '--seed'", usage=True),
    Case("int-block-size-huge", CAL + " -o {t}/c --block-size 100000", "Invalid value for '--block-size'", usage=True),
    Case("int-concurrency-huge", CAL + " -o {t}/c --concurrency 99999999", "Invalid value for '--concurrency'", usage=True),
    Case("int-max-new-tokens-huge", BENCH + " --max-new-tokens 4000000000", "Invalid value for '--max-new-tokens'", usage=True),
    Case("int-num-prompts-huge", BENCH + " --num-prompts 99999999999", "Invalid value for '--num-prompts'", usage=True),
    Case("int-concurrency-list-huge", BENCH + " --concurrency 1,100000", "--concurrency values must be <= 4096"),
    Case("int-contexts-huge", "profile-hardware --contexts 8,99999999999", "--contexts values must be <="),
    Case("int-schedule-context-negative", SCHED + " --context -1", "Invalid value for '--context'", usage=True),
    Case("int-server-concurrency-zero", REGEN + " --server http://x --server-concurrency 0",
         "Invalid value for '--server-concurrency'", usage=True),
    Case("int-max-retries-huge", REGEN + " --server http://x --max-retries 1000000", "Invalid value for '--max-retries'",
         usage=True),
    Case("int-stop-after-zero", TRAIN + " -o {t}/run --stop-after 0", "Invalid value for '--stop-after'", usage=True),
    Case("int-warmup-negative", "profile-hardware --warmup -1", "Invalid value for '--warmup'", usage=True),
    Case("int-drafter-option-range", "bench -d ddtree:dspark,tree_budget=-5",
         "--drafter 'ddtree:dspark,tree_budget=-5': tree_budget must be an integer >= 1"),
    Case("int-scheduler-option-range", BENCH + " -s async,delay=-5 --cost-table {d}/cost.json",
         "--scheduler 'async,delay=-5': delay must be >= 1"),
    Case("int-scheduler-option-huge", SCHED + " -s async,delay=99999999999999999999", "delay is out of range"),
    Case("msg-scheduler-option-names-the-spec", BENCH + " -s threshold,threshold=7",
         "--scheduler 'threshold,threshold=7': threshold must be in [0, 1]"),
    Case("int-drafter-option-huge", "bench -d ddtree:dspark,tree_budget=99999999999999999999", "tree_budget is out of range"),
    # -- options that cannot apply are errors; messages name what the user typed
    Case("na-profile-block-size-without-drafter", "profile-hardware --block-size 5", "--block-size has no effect without --drafter"),
    Case("na-profile-row-tokens-with-drafter", "profile-hardware -d dspark --row-tokens 4", "--row-tokens has no effect with --drafter"),
    Case("na-calibrate-traces-with-sampling", "calibrate -d dspark --traces {d}/traces.jsonl -o {t}/c --temperature 0.5 --seed 3",
         "--temperature, --seed have no effect with --traces"),
    Case("na-regenerate-server-with-device", REGEN + " --server http://x --device cpu", "--device has no effect with --server"),
    Case("na-regenerate-model-without-server", REGEN + " --model m", "--model has no effect without --server"),
    Case("na-regenerate-server-batch-invariant", REGEN + " --server http://x --batch-invariant",
         "--batch-invariant has no effect with --server"),
    Case("na-calibrate-traces-batch-invariant", "calibrate -d dspark --traces {d}/traces.jsonl -o {t}/c --no-batch-invariant",
         "--no-batch-invariant has no effect with --traces"),
    Case("na-schedule-threshold-unused", SCHED + " --threshold 0.3", "--threshold has no effect without --scheduler threshold"),
    Case("msg-push-file-not-folder", "push {d}/afile.txt --repo-id alice/x", "checkpoint {d}/afile.txt: is a file, not a checkpoint folder"),
    Case("msg-init-from-file", TRAIN + " -o {t}/run --init-from {d}/afile.txt", "--init-from {d}/afile.txt: is a file, not a checkpoint folder"),
    Case("msg-resume-file", "train --resume -o {d}/afile.txt", "is a file, not a run folder"),
    Case("msg-train-output-file", TRAIN + " -o {d}/afile.txt", "--output {d}/afile.txt: is a file, not a folder"),
    Case("msg-regenerate-recipe-output-named", "data regenerate --recipe {d}/recipe_outdir.toml",
         "data.path of --recipe {d}/recipe_outdir.toml {d}/folder: is a folder"),
    Case("msg-dataset-is-device", BENCH + " --dataset /dev/zero", "dataset /dev/zero: is a device or socket, not a jsonl file"),
    Case("msg-cost-table-dangling", BENCH + " -s hardware --cost-table {d}/dangling", "a symbolic link to nothing"),
]
if not torch.cuda.is_available():
    CASES.append(Case("device-cuda-missing", BENCH + " --device cuda", "--device cuda:"))
if Path("/proc/self").is_dir():  # every command proves its output paths before any work
    CASES += [
        Case(f"unwritable-{name}", f"{args} {PROC}/{path}", f"{option} {PROC}/{path}: cannot write in /proc")
        for name, args, option, path in [
            ("bench-json", BENCH + " --json", "--json", "b.json"),
            ("bench-plots", BENCH + " --plots", "--plots", "plots"),
            ("calibrate-output", CAL + " -o", "--output", "c"),
            ("calibrate-traces", CAL + " -o {t}/c --save-traces", "--save-traces", "t.jsonl"),
            ("regenerate-output", "data regenerate --dataset {d}/good.jsonl -o", "--output", "r.jsonl"),
            ("regenerate-json", REGEN + " --json", "--json", "r.json"),
            ("train-output", TRAIN + " -o", "--output", "run"),
            ("train-feature-cache", TRAIN + " -o {t}/run --feature-cache", "--feature-cache", "cache"),
            ("profile-json", "profile-hardware --json", "--json", "cost.json"),
            ("profile-plots", "profile-hardware --plots", "--plots", "plots"),
            ("schedule-json", SCHED + " --json", "--json", "s.json"),
            ("export-output", "export {d}/ckpt_corrupt --format vllm --output", "--output", "e"),
            ("export-json", "export {d}/ckpt_corrupt --format vllm --output {t}/e --json", "--json", "e.json"),
            ("push-json", "push {d}/ckpt_corrupt --repo-id alice/x --json", "--json", "p.json"),
            ("drafters-json", "drafters --json", "--json", "d.json"),
            ("datasets-json", "datasets --json", "--json", "d.json"),
        ]
    ]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("inputs")
    (d / "folder").mkdir()
    (d / "folder" / "keep.txt").write_text("x\n")
    (d / "afile.txt").write_text("x\n")
    (d / "good.jsonl").write_text('{"turns": ["hello"]}\n')
    (d / "good-token.jsonl").write_text('{"turns": ["hello"]}\n')  # --save-traces good.jsonl's token-rule file
    (d / "bad_json.jsonl").write_text('{"turns": ["hello"]}\n{"turns": [\n')
    (d / "bad_utf8.jsonl").write_bytes(b'{"turns": ["hello"]}\n{"turns": ["\xff"]}\n')
    (d / "no_turns.jsonl").write_text('{"text": "hello"}\n')
    (d / "list.jsonl").write_text('["hello"]\n')
    (d / "empty.jsonl").write_text("\n")
    (d / "empty_turn.jsonl").write_text('{"turns": [" "]}\n')
    (d / "bad_role.jsonl").write_text(json.dumps({"messages": [{"role": "robot", "content": "hi"}]}) + "\n")
    (d / "long.jsonl").write_text(json.dumps({"turns": ["word " * 4000]}) + "\n")
    CostTable("cpu", "test CPU", "float32", "embedded:tiny-target", torch.__version__, [1, 2], [8],
              {"8": [100.0, 90.0]}).save(d / "cost.json")
    (d / "traces.jsonl").write_text('{"confidence": [0.5], "accepted": 1}\n')
    ckpt = d / "ckpt_corrupt"
    shutil.copytree(embedded_path("drafters") / "dspark-markov", ckpt)
    (ckpt / "model.safetensors").write_bytes(b"not safetensors")
    (d / "ckpt_binary_config").mkdir()
    (d / "ckpt_binary_config" / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    (d / "binary.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    (d / "surrogate.jsonl").write_text('{"turns": ["hello"]}\n{"turns": ["\\ud800"]}\n')
    (d / "surrogate_conv.jsonl").write_text('{"messages": [{"role": "user", "content": "a\\udc00"}]}\n')
    (d / "object.json").write_text('{"a": 1}\n')
    (d / "bad_grid.json").write_text(json.dumps({"device": "cpu", "device_name": "x", "dtype": "float32", "model": "m",
                                                 "torch": "t", "grid": "abc", "contexts": [8], "sps": {"8": [1.0]}}))
    (d / "bad.toml").write_text("x = = 1\n")
    with socket.socket(socket.AF_UNIX) as sock:  # the socket file stays after close
        sock.bind(str(d / "socket"))
    _record_files(d)
    return d


def _record_files(d: Path) -> None:
    """Links, a FIFO, and files whose JSON or TOML breaks a record's rules."""
    (d / "link_to_good").symlink_to(d / "good.jsonl")
    os.link(d / "good.jsonl", d / "hardlink_good")
    (d / "loop").symlink_to(d / "loop")
    (d / "dangling").symlink_to(d / "nowhere.json")
    os.mkfifo(d / "fifo")
    (d / "afile.txt").touch()
    table = json.loads((d / "cost.json").read_text())
    for name, change in [("cost_nan", '"sps": {"8": [NaN, 1.0]}'), ("cost_overflow", '"sps": {"8": [1e999, 1.0]}'),
                         ("cost_bigint", '"grid": [1, 100000000000000000000000]'), ("cost_bool", '"grid": [true, 2]'),
                         ("cost_unsorted", '"grid": [2, 1]')]:
        key = change.split('"')[1]
        text = json.dumps({k: v for k, v in table.items() if k != key})
        (d / f"{name}.json").write_text(text[:-1] + ", " + change + "}")
    (d / "deep.json").write_text('{"device": ' + "[" * 100 + "]" * 100 + "}")
    (d / "deep.jsonl").write_text('{"turns": ' + "[" * 100 + "]" * 100 + "}\n")
    (d / "inf.jsonl").write_text('{"turns": ["hi"], "weight": Infinity}\n')
    (d / "bigint.jsonl").write_text('{"id": 123456789012345678901234567890, "turns": ["hi"]}\n')
    negctx = json.loads((d / "cost.json").read_text())
    (d / "cost_negctx.json").write_text(json.dumps({**negctx, "contexts": [-1], "sps": {"-1": [100.0, 90.0]}}))
    (d / "cal_empty.json").write_text('{"temperatures": []}')
    (d / "cal_zero.json").write_text('{"temperatures": [0]}')
    (d / "sps_strings.json").write_text(json.dumps({"sample_batch_tokens": ["1"], "sample_steps_per_sec": [1.0],
                                                    "max_batch_tokens": 8}))
    (d / "cal_nan.json").write_text('{"temperatures": [1.0, NaN]}')
    (d / "cal_string_block.json").write_text('{"temperatures": [1.0], "block_size": "1"}')
    (d / "cal_reserved.json").write_text('{"temperatures": [1.0], "chat_template_kwargs": {"tokenize": true}}')
    (d / "cal_surrogate.json").write_text('{"temperatures": [1.0], "drafter": "x\\udfff"}')
    (d / "traces_nan.jsonl").write_text('{"confidence": [NaN], "accepted": 1}\n')
    recipe = (REPO / "recipes" / "tiny" / "dspark-markov.toml").read_text()
    (d / "recipe_nan.toml").write_text(recipe.replace("lr = 1e-3", "lr = nan"))
    (d / "recipe_date.toml").write_text(recipe + "\n[chat_template]\nsince = 2024-01-01\n")
    (d / "recipe_deep.toml").write_text(recipe + "\n[chat_template]\nx = " + "[" * 60 + "]" * 60 + "\n")
    (d / "recipe_regen0.toml").write_text(recipe.replace("max_new_tokens = 256", "max_new_tokens = 0"))
    (d / "recipe_outdir.toml").write_text(recipe.replace('path = ["work-data/tiny/train-regenerated.jsonl", '
                                                         '"work-data/tiny/train-regenerated-t1.jsonl"]',
                                                         f'path = "{d}/folder"').replace(
        'prompts = "work-data/tiny/prompts-train.jsonl"', f'prompts = "{d}/good.jsonl"'))
    (d / "self_output.toml").write_text(recipe.replace('path = ["work-data/tiny/train-regenerated.jsonl", '
                                                       '"work-data/tiny/train-regenerated-t1.jsonl"]',
                                                       f'path = "{d}/self_output.toml"').replace(
        'prompts = "work-data/tiny/prompts-train.jsonl"', f'prompts = "{d}/good.jsonl"'))


def _snapshot(*roots: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_fifo() else "other"
            for root in roots for p in sorted(root.rglob("*")) if not p.is_symlink()}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, inputs, tmp_path, capsys, monkeypatch, request):
    import importlib

    if case.hub:
        request.getfixturevalue("hub")
    for target, value in case.patch.items():
        module, attr = target.split(":")
        monkeypatch.setattr(importlib.import_module(module), attr, value)
    if not case.loads:
        from dspec_cli.runtime.target import Target

        monkeypatch.setattr(Target, "load", _no_model)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    args = case.args.format(d=inputs, t=out, r=REPO, a=ASSETS_DIR).split()
    before = _snapshot(inputs, tmp_path)
    code, _, err = run_cli(args, capsys)
    match = case.match.format(d=inputs, t=out, a=ASSETS_DIR)
    assert code != 0 and "Traceback" not in err, err
    assert code == (case.code or (2 if case.usage else 1)), err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and match in lines[0], err
    assert lines[0].startswith("Error: ") or code == 130, err
    assert _snapshot(inputs, tmp_path) == before  # nothing created, changed or half-written


def test_table_is_large_enough():
    assert len(CASES) >= 200  # grows with every class of bad input (docs/cli.md)


def test_every_float_option_refuses_nan_in_the_table():
    """The float options of every command appear in a NaN / infinity row above."""
    from test_cli_conventions import _commands, _options

    floats = {(c, n) for c, cmd in _commands().items() for n, p in _options(cmd).items()
              if "float" in str(p.type_descriptor.annotation)}
    covered = {(c, n) for c, n in floats if any(
        c.split()[0] in case.args.split()[0] and n in case.args and "finite" in case.match for case in CASES)}
    assert len(floats) >= 8 and floats == covered


def test_every_integer_option_has_a_range():
    """Integer options are ``options.int_option``s: out of range is a usage error before anything
    loads, naming the option (an overflow inside torch after the model loaded named nothing)."""
    from test_cli_conventions import _commands, _options

    ints = {(c, n): p for c, cmd in _commands().items() for n, p in _options(cmd).items()
            if "int" in str(p.type_descriptor.annotation) and not p.is_flag}
    assert len(ints) >= 25
    assert [k for k, p in ints.items() if p.min is None or p.max is None] == []


def test_a_verify_rule_no_round_used_is_a_warning_in_the_json(capsys):
    """Whether a --verify rule fits shows only in the run: one that no round used is a warning,
    on stderr and in the run's JSON, never silence."""
    code, out, err = run_cli([*BENCH.split(), "--verify", "traversal", "--json", "-"], capsys)
    assert code == 0, err
    (run,) = json.loads(out)["runs"]
    expected = "--verify traversal: no round of prompt-lookup used it"
    assert any(w.startswith(expected) for w in run["warnings"]) and f"Warning: {expected}" in err

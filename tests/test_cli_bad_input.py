"""Bad input, one table: every row must exit non-zero (usage errors: 2) with exactly one ``Error:
...`` line on stderr, no traceback, and no file created, changed or half-written. Rows run
in-process; most fail before any model loads."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from tiny_models import run_cli

from dspec_cli.core.files import embedded_path
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


REPO = Path(__file__).resolve().parents[1]
BENCH = "bench -d prompt-lookup --num-prompts 1 --max-new-tokens 4"
CAL = "calibrate -d dspark --num-prompts 1 --max-new-tokens 4"
SCHED = "schedule --cost-table {d}/cost.json --traces {d}/traces.jsonl"
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
    Case("regenerate-output-is-input", "data regenerate --dataset {d}/good.jsonl -o {d}/good.jsonl", "--output must differ"),
    Case("dataset-lone-surrogate", BENCH + " --dataset {d}/surrogate.jsonl", "surrogate.jsonl:2: holds a lone surrogate \\ud800"),
    Case("calibrate-lone-surrogate", CAL + " -o {t}/c --dataset {d}/surrogate.jsonl", "surrogate.jsonl:2: holds a lone"),
    Case("regenerate-lone-surrogate", "data regenerate --dataset {d}/surrogate_conv.jsonl -o {t}/r.jsonl",
         "surrogate_conv.jsonl:1: holds a lone surrogate \\udc00"),
    Case("cost-table-binary", BENCH + " -s hardware --cost-table {d}/binary.bin", "--cost-table {d}/binary.bin: not a text file"),
    Case("cost-table-folder", BENCH + " -s hardware --cost-table {d}/folder", "--cost-table {d}/folder: is a folder"),
    Case("cost-table-not-a-table", BENCH + " -s hardware --cost-table {d}/object.json", "not a cost table (missing key(s)"),
    Case("cost-table-bad-types", BENCH + " -s hardware --cost-table {d}/bad_grid.json", "--cost-table {d}/bad_grid.json: "),
    Case("schedule-cost-table-binary", "schedule --cost-table {d}/binary.bin --traces {d}/traces.jsonl", "--cost-table {d}/binary.bin: not a text file"),
    Case("calibration-binary", SCHED + " --calibration {d}/binary.bin", "--calibration {d}/binary.bin: not a text file"),
    Case("calibration-bad-json", SCHED + " --calibration {d}/bad_json.jsonl", "--calibration {d}/bad_json.jsonl: not valid JSON"),
    Case("calibration-not-calibration", SCHED + " --calibration {d}/object.json", "expected an object with 'temperatures'"),
    Case("traces-binary", "schedule --cost-table {d}/cost.json --traces {d}/binary.bin", "binary.bin:1: not valid UTF-8"),
    Case("recipe-binary", "train --recipe {d}/binary.bin -o {t}/run", "--recipe {d}/binary.bin: not a text file"),
    Case("recipe-bad-toml", "train --recipe {d}/bad.toml -o {t}/run", "--recipe {d}/bad.toml: not valid TOML"),
    Case("regenerate-recipe-binary", "data regenerate --recipe {d}/binary.bin", "--recipe {d}/binary.bin: not a text file"),
    Case("train-second-data-file", TRAIN + " -o {t}/run data.path=[\"{d}/good.jsonl\",\"{d}/nope.jsonl\"]",
         "nope.jsonl' (data.path) not found; create it with `dspec data regenerate --recipe"),
    Case("checkpoint-config-binary", "bench -d dspark --checkpoint {d}/ckpt_binary_config --num-prompts 1",
         "checkpoint config {d}/ckpt_binary_config/config.json: not a text file", loads=True),
    # -- options
    Case("unknown-drafter", "bench -d nope", "unknown drafter 'nope'"),
    Case("unknown-drafter-option", "bench -d dspark,speed=2", "unknown option(s) speed"),
    Case("unknown-scheduler", BENCH + " -s fastest", "unknown scheduler 'fastest'"),
    Case("scheduler-needs-cost-table", BENCH + " -s hardware", "--scheduler hardware needs --cost-table"),
    Case("concurrency-zero", BENCH + " --concurrency 0", "--concurrency values must be >= 1"),
    Case("concurrency-not-a-list", BENCH + " --concurrency 1,x", "--concurrency must be a comma-separated list"),
    Case("temperature-negative", BENCH + " --temperature -1", "--temperature must be >= 0"),
    Case("top-p-zero", BENCH + " --top-p 0", "--top-p must be in (0, 1]"),
    Case("top-k-negative", BENCH + " --top-k -1", "--top-k must be >= 0"),
    Case("max-new-tokens-zero", "bench -d prompt-lookup --max-new-tokens 0", "--max-new-tokens must be >= 1"),
    Case("num-prompts-zero", "bench -d prompt-lookup --num-prompts 0", "--num-prompts must be >= 1"),
    Case("repeats-zero", BENCH + " --repeats 0", "--repeats must be >= 1"),
    Case("block-size-zero", BENCH + " --block-size 0", "--block-size must be >= 1"),
    Case("device-unknown", BENCH + " --device tpu9", "--device 'tpu9'"),
    Case("dtype-unknown", BENCH + " --dtype int8", "unknown dtype 'int8'"),
    Case("checkpoints-per-drafter", BENCH + " --checkpoint a --checkpoint b", "give one --checkpoint per --drafter"),
    Case("profile-contexts-zero", "profile-hardware --contexts 0,8", "--contexts values must be >= 1"),
    Case("profile-repeats-zero", "profile-hardware --repeats 0", "--repeats must be >= 1"),
    Case("profile-context-too-long", "profile-hardware --contexts 99999 --grid 1 --repeats 1", "exceeds the model's context", loads=True),
    Case("schedule-steps-zero", SCHED + " --steps 0", "--steps must be >= 1"),
    Case("schedule-layout", SCHED + " --layout ragged", "layout"),
    Case("export-format", "export {d}/folder --format tensorrt --output {t}/e", "--format must be one of"),
    Case("missing-required", "calibrate", "Missing option '--drafter'", usage=True),
    Case("bench-nothing-to-measure", "bench", "give --drafter (dspec's engine) or --server with --baseline-server"),
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
    Case("calibrate-output-is-checkpoint", CAL + " --checkpoint {d}/ckpt_corrupt -o {d}/ckpt_corrupt", "pass --in-place"),
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
    return d


def _snapshot(*roots: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for root in roots for p in sorted(root.rglob("*"))}


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
    args = case.args.format(d=inputs, t=out, r=REPO).split()
    before = _snapshot(inputs, tmp_path)
    code, _, err = run_cli(args, capsys)
    match = case.match.format(d=inputs, t=out)
    assert code != 0 and "Traceback" not in err, err
    assert code == (case.code or (2 if case.usage else 1)), err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and match in lines[0], err
    assert lines[0].startswith("Error: ") or code == 130, err
    assert _snapshot(inputs, tmp_path) == before  # nothing created, changed or half-written


def test_table_is_large_enough():
    assert len(CASES) >= 80


def test_every_float_option_refuses_nan_in_the_table():
    """The float options of every command appear in a NaN / infinity row above."""
    from test_cli_conventions import _commands, _options

    floats = {(c, n) for c, cmd in _commands().items() for n, p in _options(cmd).items()
              if "float" in str(p.type_descriptor.annotation)}
    covered = {(c, n) for c, n in floats if any(
        c.split()[0] in case.args.split()[0] and n in case.args and "finite" in case.match for case in CASES)}
    assert len(floats) >= 8 and floats == covered

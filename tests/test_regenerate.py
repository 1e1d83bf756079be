"""dspec data regenerate: multi-turn self-distillation through the engine, resumable output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import tiny_qwen3, tiny_target, tiny_tokenizer

from dspec_cli.core.data import load_conversations
from dspec_cli.core.errors import DspecError
from dspec_cli.training.regenerate import (
    RegenerateOptions,
    regenerate,
    turn_seed,
)

TESTS = Path(__file__).resolve().parent


def write_prompts(path: Path, n: int = 10) -> Path:
    lines = []
    for i in range(n):
        if i % 3 == 0:  # ShareGPT with a system prompt and an original answer to be replaced
            lines.append({"id": f"s{i}", "conversations": [
                {"from": "system", "value": "Be brief."}, {"from": "human", "value": f"What is {i} plus {i}?"},
                {"from": "gpt", "value": "ORIGINAL ANSWER"}, {"from": "human", "value": "Are you sure?"}]})
        else:
            turns = [f"Tell me about the sea, part {i}."] + (["Continue."] if i % 2 else [])
            lines.append({"turns": turns})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def _opts(tmp: Path, **kw) -> RegenerateOptions:
    base = dict(prompts=str(write_prompts(tmp / "prompts.jsonl")), output=tmp / "out.jsonl", max_new_tokens=12,
                concurrency=1, seed=3)
    return RegenerateOptions(**{**base, **kw})


def test_regenerates_every_assistant_turn_turn_by_turn(tmp_path, target):
    stats = regenerate(_opts(tmp_path, concurrency=3), target=target)
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert stats.written == len(lines) == 10 and stats.turns == 17
    first = lines[0]
    assert first["id"] == "s0"
    assert [m["role"] for m in first["conversations"]] == ["system", "user", "assistant", "user", "assistant"]
    assert all(m["content"] != "ORIGINAL ANSWER" for m in first["conversations"])
    assert lines[1]["id"] == "prompts-2" and [m["role"] for m in lines[1]["conversations"]] == ["user", "assistant", "user", "assistant"]
    assert all(isinstance(m["content"], str) for line in lines for m in line["conversations"])
    # the output is valid training data
    assert len(load_conversations(tmp_path / "out.jsonl")) == 10


def test_interrupted_run_resumes_to_the_same_file(tmp_path, target):
    full = tmp_path / "full"
    full.mkdir()
    regenerate(_opts(full), target=target)
    expected = (full / "out.jsonl").read_bytes()
    part = tmp_path / "part"
    part.mkdir()
    seen = []

    def progress(_desc, _total):
        def tick(_res):
            seen.append(1)
            if len(seen) == 9:  # mid-way through the second chunk of 4 conversations
                raise KeyboardInterrupt

        return tick

    with pytest.raises(KeyboardInterrupt):
        regenerate(_opts(part), progress, target=target)
    out = part / "out.jsonl"
    assert len(out.read_text().splitlines()) == 4
    with open(out, "a") as f:
        f.write('{"id": "prompts-7", "conversa')  # a write cut short by the interruption
    stats = regenerate(_opts(part), target=target)
    assert stats.already_done == 4 and stats.written == 6 and stats.notes
    assert out.read_bytes() == expected
    assert regenerate(_opts(part), target=target).written == 0  # nothing left to do


def test_greedy_output_is_the_same_with_a_drafter(tmp_path, target):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    regenerate(_opts(tmp_path, output=a, temperature=0.0, concurrency=4), target=target)
    regenerate(_opts(tmp_path, output=b, temperature=0.0, concurrency=4, drafter="prompt-lookup"), target=target)
    assert a.read_text() == b.read_text()


def test_turn_seeds_do_not_depend_on_position():
    assert turn_seed(0, "a", 1) == turn_seed(0, "a", 1) != turn_seed(0, "a", 2)
    assert 0 <= turn_seed(7, "b", 0) < 2**31


def test_context_overflow_shortens_or_skips(tmp_path, target):
    long = "word " * 150
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "turns": ["hi", long]}) + "\n" + json.dumps({"id": "b", "turns": [long * 2]}) + "\n")
    stats = regenerate(RegenerateOptions(prompts=str(path), output=tmp_path / "o.jsonl", max_new_tokens=16), target=target)
    assert stats.written == 1 and stats.shortened == 1 and stats.skipped == 1
    line = json.loads((tmp_path / "o.jsonl").read_text())
    assert [m["role"] for m in line["conversations"]] == ["user", "assistant"]


def test_answers_cut_at_max_new_tokens_are_kept_and_counted(tmp_path, target, monkeypatch):
    from dspec_cli.runtime.engine import SpeculativeEngine

    generate = SpeculativeEngine.generate
    lengths: dict[int, bool] = {}  # per answered turn: stopped at max_new_tokens

    def spy(self, prompts, **kw):
        results = generate(self, prompts, **kw)
        lengths.update({len(lengths) + i: r.finish_reason == "length" for i, r in enumerate(results)})
        return results

    monkeypatch.setattr(SpeculativeEngine, "generate", spy)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "turns": [f"Tell me about {i}."]}) + "\n" for i in range(6)))
    stats = regenerate(RegenerateOptions(prompts=str(path), output=tmp_path / "o.jsonl", max_new_tokens=3,
                                         concurrency=6, seed=1), target=target)
    assert stats.written == 6 and stats.truncated == sum(lengths.values()) >= 1


def test_bad_input_lines_name_file_and_line(tmp_path, target):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"conversations": [{"role": "tool", "content": "x"}]}\n')
    with pytest.raises(DspecError, match=r"bad.jsonl:2: .*role 'tool'"):
        regenerate(RegenerateOptions(prompts=str(bad), output=tmp_path / "o.jsonl"), target=target)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": 1, "turns": ["a"]}\n{"id": "1", "turns": ["b"]}\n')
    with pytest.raises(DspecError, match=r"dup.jsonl:2: duplicate id '1'"):
        regenerate(RegenerateOptions(prompts=str(dup), output=tmp_path / "o.jsonl"), target=target)
    out = tmp_path / "damaged.jsonl"
    out.write_text('{"id": "x", "conversations": []}\nnot json\n')
    with pytest.raises(DspecError, match=r"damaged.jsonl:2: not valid JSON"):
        regenerate(_opts(tmp_path, output=out), target=target)


def test_cli_regenerate(tmp_path, capsys):
    tdir = tmp_path / "target"
    tiny_qwen3().save_pretrained(tdir)
    tiny_tokenizer().save_pretrained(tdir)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3)
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS.parent / "plugins")])}
    args = ["data", "regenerate", "--target", str(tdir), "--prompts", str(prompts), "--output", str(out),
            "--max-new-tokens", "8", "--device", "cpu"]
    ok = subprocess.run([sys.executable, "-m", "dspec_cli", *args], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    assert "wrote 3 conversation(s)" in ok.stdout and len(out.read_text().splitlines()) == 3
    from tiny_models import run_cli

    code, stdout, err = run_cli([*args, "--json", "-"], capsys)  # resumed: all done, the counts as JSON
    assert code == 0 and json.loads(stdout)["already_done"] == 3, err
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    args[args.index(str(prompts))] = str(tmp_path / "bad.jsonl")
    from dspec_cli.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 1 and err.count("\n") == 1 and "bad.jsonl:1: not valid JSON" in err

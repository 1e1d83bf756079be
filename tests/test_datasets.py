"""Prompt and benchmark sets by name, resolved from the local Hub stand-in (tests/hub_server.py)."""

from __future__ import annotations

import dataclasses
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny_models import assert_cli_error, run_cli

from dspec_cli.core import datasets as ds
from dspec_cli.core.data import load_conversations, load_prompts
from dspec_cli.core.errors import DspecError


def parquet(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


@pytest.fixture
def sets(hub, monkeypatch):  # noqa: F811
    """Small fixture copies of a few registered sets on the local Hub, the registry pinned to them."""
    files = {
        "gsm8k": {"main/test-00000-of-00001.parquet": parquet([{"question": f"What is {i} + {i}?", "answer": "x"} for i in range(5)]),
                  "main/train-00000-of-00001.parquet": parquet([{"question": "TRAIN ROW", "answer": "x"}])},
        "math500": {"test.jsonl": b'{"problem": "Solve $x^2 = 4$.", "answer": "2"}\n'},
        "humaneval": {"openai_humaneval/test-00000-of-00001.parquet": parquet([{"prompt": "def add(a, b):\n", "task_id": "H/0"}])},
        "mt-bench": {"data/train-00000-of-00001.parquet": parquet([{"prompt": ["Write a poem.", "Shorter."], "category": "writing"}])},
        "alpaca": {"data/train-00000-of-00001.parquet": parquet([{"instruction": "Translate.", "input": "Hallo"},
                                                                 {"instruction": "Name a colour.", "input": ""}])},
        "arena-hard": {"data/train-00000-of-00001.parquet": parquet([{"turns": [{"content": "Explain RAID 5."}]}])},
        "aime25": {"data/test-00000-of-00001.parquet": parquet([{"problem": "Find the largest prime below 30.", "answer": "29"}])},
        "mbpp": {"sanitized/test-00000-of-00001.parquet": parquet([{"prompt": "Write a function that reverses a list."}])},
        "livecodebench": {"test.jsonl": b'{"question_content": "Read n and print n squared."}\n',
                          "test6.jsonl": b'{"question_content": "Sort the input."}\n'},
        "open-perfectblend": {"data/train-00000-of-00001.parquet": parquet([{"conversations": [
            {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}])},
    }
    for name, content in files.items():
        spec = ds.REGISTRY[name]
        sha = hub.add_dataset(spec.repo_id, content)
        monkeypatch.setitem(ds.REGISTRY, name, dataclasses.replace(spec, revision=sha))
    return hub


def test_sets_resolve_by_name_with_the_papers_conventions(sets, monkeypatch):
    monkeypatch.setitem(ds.REGISTRY, "gsm8k", dataclasses.replace(ds.REGISTRY["gsm8k"], cap=3))
    gsm = load_prompts("gsm8k")
    assert len(gsm) == 3 and all(p.domain == "math" for p in gsm)  # capped; the train split not read
    assert all(p.text.startswith("What is ") and p.text.endswith(ds.MATH_SUFFIX) for p in gsm)
    assert load_prompts("math500")[0].text == "Solve $x^2 = 4$." + ds.MATH_SUFFIX
    (he,) = load_prompts("humaneval")
    assert he.domain == "code" and "passes the tests" in he.text and "def add(a, b):" in he.text
    (mt,) = load_prompts("mt-bench")
    assert mt.turns == ("Write a poem.",)  # first turn only ...
    assert load_prompts("mt-bench:multi-turn")[0].turns == ("Write a poem.", "Shorter.")  # ... unless asked
    alpaca = sorted(p.text for p in load_prompts("alpaca"))
    assert alpaca == ["Name a colour.", "Translate.\n\nInput:\nHallo"]
    assert load_prompts("arena-hard")[0].text == "Explain RAID 5."
    (conv,) = load_conversations("open-perfectblend")  # ShareGPT rows: training prompts for regenerate
    assert [m["role"] for m in conv.messages] == ["user", "assistant"]


def test_cached_sets_work_offline_and_uncached_ones_say_what_to_do(sets, monkeypatch, tmp_path, capsys):
    from huggingface_hub import constants

    first = load_prompts("math500")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    sets.fail("resolve", 500)  # nothing reaches the Hub any more
    assert load_prompts("math500") == first  # the formatted copy is reused
    with pytest.raises(DspecError, match=r"dataset gsm8k .*offline.*pass a local jsonl file"):
        load_prompts("gsm8k")
    capsys.readouterr()  # the download bar of the first load
    assert_cli_error(["data", "regenerate", "--prompts", "alpaca", "--output", str(tmp_path / "o.jsonl"),
                      "--server", "http://127.0.0.1:9"], capsys, "pass a local jsonl file")
    assert_cli_error(["bench", "-d", "prompt-lookup", "--dataset", "nope"], capsys,
                     "nope: file not found (nor a set that `dspec datasets` lists)")


def test_datasets_command_lists_the_sets(capsys):
    code, out, _ = run_cli(["datasets", "--json", "-"], capsys)
    rows = {r["name"]: r for r in json.loads(out)["datasets"]}
    assert code == 0 and set(ds.PAPER_SUITE) <= set(rows) and rows["open-perfectblend"]["kind"] == "train"
    assert rows["math500"]["pinned"] and rows["humaneval"]["cap"] == 164 and rows["mt-bench"]["multi_turn"]
    code, out, _ = run_cli(["datasets"], capsys)
    assert code == 0 and "livecodebench/code_generation_lite" in out


def test_domain_tau_averages_the_sets_of_each_domain():
    runs = [{"drafter": "d", "scheduler": "fixed", "concurrency": 1, "dataset": n, "tau": t}
            for n, t in [("gsm8k", 3.0), ("math500", 4.0), ("humaneval", 5.0), ("alpaca", 2.0), ("builtin", 9.0)]]
    assert ds.domain_tau(runs) == [{"drafter": "d", "scheduler": "fixed", "concurrency": 1,
                                    "math": 3.5, "code": 5.0, "chat": 2.0}]


def test_bench_suite_paper_prints_tau_per_domain(sets, tmp_path, capsys):
    report_path = tmp_path / "bench.json"
    code, out, _ = run_cli(["bench", "-d", "prompt-lookup", "--suite", "paper", "--num-prompts", "1",
                            "--max-new-tokens", "4", "--json", str(report_path)], capsys)
    report = json.loads(report_path.read_text())
    assert code == 0 and {r["dataset"] for r in report["runs"]} == set(ds.PAPER_SUITE)
    (row,) = report["domains"]
    assert all(row[d] is not None for d in ("math", "code", "chat")) and "τ per domain" in out
    assert_cli_error(["bench", "-d", "prompt-lookup", "--suite", "nope"], capsys, "--suite must be 'paper'")

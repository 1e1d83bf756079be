"""Prompt and benchmark sets by name (``--dataset gsm8k``, ``--prompts open-perfectblend``).

Each :class:`DatasetSpec` names a Hugging Face dataset repo, a revision, the files of one split
(glob patterns, as a dataset card's ``data_files``), the field(s) holding the prompt and how to
turn a row into user turns. :func:`resolve` downloads the files through huggingface_hub (the
standard cache), formats the rows as ``{"id", "turns", "domain"}`` lines and keeps the result
next to the Hub cache (``<HF_HUB_CACHE>/../dspec-datasets/``), so a second use needs no network.

Evaluation conventions follow DeepSpec's evaluation script: first user turn only unless the set
is multi-turn (mt-bench, when asked for with ``multi_turn``); math prompts end with the
boxed-answer instruction; HumanEval is wrapped as a solve-and-pass-the-tests request; each set is
capped (a seeded shuffle, then the first ``cap`` rows).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from dspec_cli.core.errors import DspecError
from dspec_cli.core.hub_env import bound_timeouts, hub_endpoint
from dspec_cli.core.jsonl import parse_lines, write_jsonl

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```"
)
_SHUFFLE_SEED = 0


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    repo_id: str
    revision: str  # a commit sha where pinned; else a release tag (livecodebench) or "main"
    split: str
    files: tuple[str, ...]  # glob patterns inside the repo (one split's data files)
    fields: tuple[str, ...]  # the row fields that make the prompt
    template: str  # "{field}" placeholders; "conversations" = a ShareGPT/messages list, kept as is
    domain: str  # math | code | chat (the paper's Table 1 columns)
    cap: int | None = None  # rows kept (seeded shuffle, then truncate); None = all
    kind: str = "eval"  # eval | train
    multi_turn: bool = False  # rows hold several user turns (mt-bench)

    @property
    def pinned(self) -> bool:
        return len(self.revision) == 40 and all(c in "0123456789abcdef" for c in self.revision)


REGISTRY: dict[str, DatasetSpec] = {s.name: s for s in [
    DatasetSpec("gsm8k", "openai/gsm8k", "60b4b82b84c2dac2b54f7d7f3056eae01514f12e", "test", ("main/test-*",), ("question",),
                "{question}" + MATH_SUFFIX, "math", 500),
    DatasetSpec("math500", "HuggingFaceH4/MATH-500", "ff5b20257d8185524591543f8ff5993951537bb8", "test",
                ("test.jsonl",), ("problem",), "{problem}" + MATH_SUFFIX, "math", 500),
    DatasetSpec("aime25", "minyichen/AIME2025", "main", "test", ("data/test-*",), ("problem",),
                "{problem}" + MATH_SUFFIX, "math", 30),
    DatasetSpec("humaneval", "openai/openai_humaneval", "7dce6050a7d6d172f3cc5c32aa97f52fa1a2e544", "test", ("openai_humaneval/test-*",), ("prompt",),
                HUMANEVAL_TEMPLATE, "code", 164),
    DatasetSpec("mbpp", "google-research-datasets/mbpp", "4bb6404fdc6cacfda99d4ac4205087b89d32030c", "test", ("sanitized/test-*",), ("prompt",),
                "{prompt}", "code", 256),
    DatasetSpec("livecodebench", "livecodebench/code_generation_lite", "release_v6", "test",
                ("test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl"),
                ("question_content",), "{question_content}", "code", 500),
    DatasetSpec("mt-bench", "HuggingFaceH4/mt_bench_prompts", "main", "train", ("data/train-*",), ("prompt",),
                "{prompt}", "chat", 80, multi_turn=True),
    DatasetSpec("alpaca", "tatsu-lab/alpaca", "main", "train", ("data/train-*",), ("instruction", "input"),
                "{instruction}\n\nInput:\n{input}", "chat", 500),
    DatasetSpec("arena-hard", "lmarena-ai/arena-hard-auto-v0.1", "2a69efe86cff85c593cfd4c2b4491c128e52c6f1", "train",
                ("data/train-*",), ("turns",), "{turns}", "chat", 500),
    DatasetSpec("open-perfectblend", "mlabonne/open-perfectblend", "main", "train", ("data/train-*",),
                ("conversations",), "conversations", "mixed", kind="train"),
    DatasetSpec("ultrachat", "HuggingFaceH4/ultrachat_200k", "main", "train_sft", ("data/train_sft-*",),
                ("messages",), "conversations", "chat", kind="train"),
]}
PAPER_SUITE = ("gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench", "mt-bench", "alpaca", "arena-hard")


MULTI_TURN = ":multi-turn"  # NAME:multi-turn keeps every user turn of a multi-turn set


def domain_tau(runs: list[dict]) -> list[dict]:
    """Mean τ per domain (math / code / chat: the paper's Table 1 columns) of each drafter, scheduler
    and concurrency, over the registered sets among ``runs`` (an unweighted mean of their τ)."""
    groups: dict[tuple, dict[str, list[float]]] = {}
    for run in runs:
        spec = REGISTRY.get(str(run["dataset"]).removesuffix(MULTI_TURN))
        if spec is None or spec.kind != "eval" or run.get("tau") is None:
            continue
        key = (run["drafter"], run["scheduler"], run["concurrency"])
        groups.setdefault(key, {}).setdefault(spec.domain, []).append(run["tau"])
    return [{"drafter": d, "scheduler": s, "concurrency": c,
             **{dom: (sum(v) / len(v) if (v := taus.get(dom)) else None) for dom in ("math", "code", "chat")}}
            for (d, s, c), taus in groups.items()]


def is_registered(name: str) -> bool:
    return name.removesuffix(MULTI_TURN) in REGISTRY


def describe() -> list[dict]:
    """The registry as plain dicts (``dspec datasets --json``)."""
    return [{**asdict(s), "files": list(s.files), "fields": list(s.fields), "pinned": s.pinned}
            for s in REGISTRY.values()]


def _cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).parent / "dspec-datasets"


def _download(spec: DatasetSpec) -> list[Path]:
    from huggingface_hub import snapshot_download

    bound_timeouts()
    try:
        folder = snapshot_download(spec.repo_id, repo_type="dataset", revision=spec.revision,
                                   allow_patterns=list(spec.files), endpoint=hub_endpoint())
    except Exception as exc:  # noqa: BLE001 - every Hub failure becomes one line naming the way out
        from huggingface_hub import constants

        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        offline = constants.HF_HUB_OFFLINE or "offline" in text.lower() or "connect" in text.lower()
        why = "the Hub is offline (HF_HUB_OFFLINE=1 or no network) and it is not cached" if offline else text
        raise DspecError(
            f"dataset {spec.name} ({spec.repo_id}@{spec.revision}): {why}; pass a local jsonl file of "
            '{"turns": [...]} lines instead'
        ) from None
    files = sorted(p for pattern in spec.files for p in Path(folder).glob(pattern))
    if not files:
        raise DspecError(f"dataset {spec.name}: {spec.repo_id}@{spec.revision} has no file matching {', '.join(spec.files)}")
    return files


def _rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DspecError(f"reading {path.name} needs pyarrow: pip install pyarrow") from None
        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        return data if isinstance(data, list) else data.get("data", [])
    return [obj for _, obj in parse_lines(text, path.name)]


def format_row(spec: DatasetSpec, row: dict, where: str, multi_turn: bool = False) -> dict:
    """One ``{"turns": [...]}`` (eval) or ``{"conversations": [...]}`` (train) line from a Hub row."""
    missing = [f for f in spec.fields if f not in row]
    if missing:
        raise DspecError(f"{where}: no field {missing[0]!r} (dataset {spec.name} expects {', '.join(spec.fields)})")
    if spec.template == "conversations":
        return {"conversations": row[spec.fields[0]]}
    value = row[spec.fields[0]]
    if isinstance(value, list):  # several turns: strings (mt-bench) or {"content": ...} (arena-hard)
        turns = [t["content"] if isinstance(t, dict) else t for t in value]
        turns = turns if multi_turn and spec.multi_turn else turns[:1]
    elif len(spec.fields) > 1 and not all(row.get(f) for f in spec.fields[1:]):
        turns = [str(value)]  # alpaca without an input: the instruction alone
    else:
        fill = lambda m: str(row[m[1]]) if m[1] in spec.fields else m[0]  # noqa: E731 - other braces stay
        turns = [re.sub(r"\{(\w+)\}", fill, spec.template)]
    return {"turns": turns}


def resolve(name: str) -> Path:
    """The local formatted jsonl of a registered set (downloaded and formatted on first use)."""
    multi_turn = name.endswith(MULTI_TURN)
    name = name.removesuffix(MULTI_TURN)
    spec = REGISTRY[name]
    out = _cache_dir() / f"{name}-{spec.revision[:12]}{'-mt' if multi_turn else ''}.jsonl"
    if out.is_file():
        return out
    rows = [(f"{path.name}:{i + 1}", row) for path in _download(spec) for i, row in enumerate(_rows(path))]
    if spec.cap is not None and len(rows) > spec.cap:
        random.Random(_SHUFFLE_SEED).shuffle(rows)
        rows = rows[: spec.cap]
    write_jsonl(out, ({"id": f"{name}-{i}", **format_row(spec, row, f"dataset {name} {where}", multi_turn),
                       "domain": spec.domain} for i, (where, row) in enumerate(rows)))
    return out

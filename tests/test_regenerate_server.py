"""dspec data regenerate --server: a real `transformers serve` of the embedded target, and retries."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_regenerate import write_prompts
from tiny_models import assert_cli_error, run_cli

from dspec_cli.core.files import DEFAULT_TARGET_PATH
from dspec_cli.training import regenerate_server as rs
from dspec_cli.training.regenerate import RegenerateOptions
from dspec_cli.training.regenerate_server import (
    ServerOptions,
    errors_path,
    regenerate_with_servers,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``transformers serve`` of the embedded tiny target on 127.0.0.1 (fp32, greedy-deterministic)."""
    pytest.importorskip("fastapi", reason="transformers[serving] is not installed")
    pytest.importorskip("uvicorn", reason="transformers[serving] is not installed")
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    if exe is None:
        pytest.skip("the transformers CLI is not installed")
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}  # one thread: ~6 ms a token here
    with open(log, "w") as logf:
        proc = subprocess.Popen([exe, "serve", str(DEFAULT_TARGET_PATH), "--host", "127.0.0.1", "--port", str(port),
                                 "--device", "cpu", "--dtype", "float32"], stdout=logf, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):  # start-up: imports and loading, ~10 s on a busy 2-core box
            if proc.poll() is not None:
                pytest.skip(f"transformers serve exited with {proc.returncode}: {log.read_text()[-500:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            pytest.skip(f"transformers serve did not come up in 120 s: {log.read_text()[-500:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _opts(tmp: Path, out: str = "out.jsonl", **kw) -> RegenerateOptions:
    prompts = tmp / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(prompts, 6)
    base = dict(prompts=str(prompts), output=tmp / out, max_new_tokens=10, temperature=0.0, top_k=0, seed=3)
    return RegenerateOptions(**{**base, **kw})


def test_real_server_regenerates_interrupts_and_resumes(server, tmp_path):
    sopts = ServerOptions([server + "/v1"], concurrency=2)
    full = regenerate_with_servers(_opts(tmp_path, "full.jsonl"), sopts)
    lines = [json.loads(x) for x in (tmp_path / "full.jsonl").read_text().splitlines()]
    assert full.written == len(lines) == 6 and full.turns == 10 and full.failed == 0 and full.generated_tokens > 0
    by_id = {x["id"]: x["conversations"] for x in lines}
    s0 = by_id["s0"]  # system kept, the original answer replaced, both user turns answered in order
    assert [m["role"] for m in s0] == ["system", "user", "assistant", "user", "assistant"]
    assert s0[1]["content"] == "What is 0 plus 0?" and "ORIGINAL ANSWER" not in {m["content"] for m in s0}
    assert not errors_path(tmp_path / "full.jsonl").exists()

    seen = []

    class Interrupted(Exception):
        pass

    def progress(total):
        assert total == 6

        def tick(_tokens):
            seen.append(1)
            if len(seen) == 3:
                raise Interrupted  # stops the run with other conversations in flight

        return tick

    with pytest.raises(Interrupted):
        regenerate_with_servers(_opts(tmp_path), sopts, progress)
    out = tmp_path / "out.jsonl"
    assert len(out.read_text().splitlines()) == 3
    with open(out, "a") as f:
        f.write('{"id": "prompts-5", "conversa')  # a write cut short by the interruption
    resumed = regenerate_with_servers(_opts(tmp_path), sopts)
    assert resumed.already_done == 3 and resumed.written == 3 and resumed.notes
    assert sorted(out.read_text().splitlines()) == sorted((tmp_path / "full.jsonl").read_text().splitlines())
    assert regenerate_with_servers(_opts(tmp_path), sopts).written == 0


def test_cli_against_the_server(server, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    out = tmp_path / "o.jsonl"
    base = ["data", "regenerate", "--prompts", str(prompts), "--output", str(out), "--max-new-tokens", "4",
            "--server", server]
    code, stdout, _ = run_cli([*base, "--top-k", "0"], capsys)
    assert code == 0 and "wrote 2 conversation(s)" in stdout and "conv/s" in stdout
    # transformers serve rejects top_k: said before any work, with the way out
    assert_cli_error([*base, "--output", str(tmp_path / "x.jsonl")], capsys, "rejected a probe request: HTTP 422")
    # a --target whose chat template adds a system prompt: its data would not match the server's
    other = tmp_path / "other-target"
    other.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_TARGET_PATH / name, other / name)
    template = (DEFAULT_TARGET_PATH / "chat_template.jinja").read_text()
    (other / "chat_template.jinja").write_text("<|im_start|>system\nBe brief.<|im_end|>\n" + template)
    assert_cli_error([*base, "--top-k", "0", "--target", str(other), "--output", str(tmp_path / "y.jsonl")],
                     capsys, "serves another tokenizer or chat template than --target")
    assert_cli_error([*base, "--top-k", "0", "--model", "nope", "--output", str(tmp_path / "z.jsonl")], capsys, "does not serve 'nope'")
    assert_cli_error([*base, "--drafter", "prompt-lookup"], capsys, "--drafter has no effect with --server")


def test_cli_unreachable_server(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", 1)
    url = f"http://127.0.0.1:{_free_port()}"
    assert_cli_error(["data", "regenerate", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl"),
                      "--server", url], capsys, f"server {url}: unreachable")
    assert_cli_error(["data", "regenerate", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl"),
                      "--server", "localhost:8000"], capsys, "expected an http:// or https:// URL")


class FakeServer:
    """An OpenAI-compatible answerer behind httpx.MockTransport; ``script`` queues statuses per user text."""

    def __init__(self):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(DEFAULT_TARGET_PATH)
        self.script: dict[str, list[int]] = {}  # first user message -> statuses to answer before a 200
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        text = body["messages"][-1]["content"]
        queued = self.script.get(text, [])
        if queued:
            status = queued.pop(0)
            return httpx.Response(status, json={"error": {"message": f"scripted {status}"}}, headers={"Retry-After": "2"})
        n = len(self.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                             return_dict=False, **body.get("chat_template_kwargs", {})))
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": f"answer {n}"}}],
                                         "usage": {"prompt_tokens": n, "completion_tokens": 2}})


def test_retries_back_off_and_failures_are_retried_next_run(tmp_path, monkeypatch):
    sleeps = []

    async def record(seconds):
        sleeps.append(seconds)

    monkeypatch.setattr(rs, "_sleep", record)
    fake = FakeServer()
    fake.script = {"What is 0 plus 0?": [429, 503], "Tell me about the sea, part 1.": [400]}
    sopts = ServerOptions(["http://fake"], concurrency=1, max_retries=2)
    opts = _opts(tmp_path, top_k=20, temperature=0.7, chat_template_kwargs={"flag": 1})
    stats = regenerate_with_servers(opts, sopts, transport=httpx.MockTransport(fake))
    assert sleeps == [2.0, 2.0]  # Retry-After honoured, twice, then the conversation went through
    assert stats.written == 5 and stats.failed == 1
    errors = [json.loads(x) for x in errors_path(tmp_path / "out.jsonl").read_text().splitlines()]
    assert errors == [{"id": "prompts-2", "server": "http://fake", "error": "HTTP 400: scripted 400"}]
    sent = fake.bodies[-1]
    assert sent["model"] == "tiny" and sent["top_k"] == 20 and sent["temperature"] == 0.7
    assert sent["chat_template_kwargs"] == {"flag": 1} and sent["max_tokens"] == 10 and isinstance(sent["seed"], int)
    again = regenerate_with_servers(opts, sopts, transport=httpx.MockTransport(fake))
    assert again.already_done == 5 and again.written == 1 and again.failed == 0 and "retrying 1" in again.notes[0]
    assert not errors_path(tmp_path / "out.jsonl").exists()


def test_retries_give_up_with_the_last_reason(tmp_path, monkeypatch):
    async def no_sleep(_seconds):
        pass

    monkeypatch.setattr(rs, "_sleep", no_sleep)
    fake = FakeServer()
    fake.script = {"What is 3 plus 3?": [500] * 5}
    stats = regenerate_with_servers(_opts(tmp_path), ServerOptions(["http://fake"], max_retries=2),
                                    transport=httpx.MockTransport(fake))
    assert stats.failed == 1
    (error,) = [json.loads(x) for x in errors_path(tmp_path / "out.jsonl").read_text().splitlines()]
    assert error["id"] == "s3" and error["error"] == "HTTP 500: scripted 500 (3 tries)"

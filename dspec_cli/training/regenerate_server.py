"""``dspec data regenerate --server URL``: the target's answers from OpenAI-compatible servers.

The same self-distillation as :mod:`dspec_cli.training.regenerate` (each conversation's assistant turns
dropped and answered again, user turn by user turn, by the target), but the target runs in a
serving engine — ``vllm serve``, SGLang's ``launch_server``, TGI, ``transformers serve`` — reached
through ``POST /v1/chat/completions``. Several servers share one queue of conversations; each runs
``concurrency`` conversations at a time (a conversation stays on one server, so its turns reuse
that server's prefix cache).

Output lines are the built-in path's ``{"id", "conversations", "chat_template_kwargs"}``, appended
as conversations finish (completion order, not input order). A re-run skips ids already in the
output (and refuses one whose lines record other kwargs). A request that
keeps failing (429, 5xx, timeouts and dropped connections are retried with exponential back-off;
other 4xx answers are not) puts its conversation in ``<output stem>.errors.jsonl`` with the reason;
that file lists the latest run's failures, and those conversations are tried again on the next run.
Each turn sends ``seed`` = :func:`~dspec_cli.training.regenerate.turn_seed`, so engines that honour
per-request seeds (vLLM) reproduce a run.

Before any work the client checks every server: reachable, serving the model (``/v1/models``
names it, or names the one model to use), and tokenizing like ``--target``: a probe conversation's
``usage.prompt_tokens`` must equal its length under ``--target``'s tokenizer and chat template
(with the same ``chat_template_kwargs``). A different tokenizer or template almost never gives the
same count on the probe's mix of prose, digits, code and non-Latin text, and either would make
the data disagree with what training tokenizes. An answer must be the whole text the target
generated: a server started with a reasoning parser returns the thinking apart
(``message.reasoning_content``), which stops the run with a one-line error.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from dspec_cli.core.data import Conversation
from dspec_cli.core.errors import DspecError
from dspec_cli.core.files import DEFAULT_TARGET_PATH
from dspec_cli.core.http import PROBE, base_url
from dspec_cli.core.http import error_detail as _detail
from dspec_cli.core.http import first_line as _first_line
from dspec_cli.core.jsonl import split_lines, write_line
from dspec_cli.core.outputs import is_special, is_stdout, open_append
from dspec_cli.nn.backbone import max_context
from dspec_cli.training.regenerate import (
    Dialogue,
    RegenerateOptions,
    RegenerateStats,
    plan,
    turn_seed,
)

RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
REASONING_FIELDS = ("reasoning_content", "reasoning")  # where a reasoning parser puts the thinking (SGLang, vLLM)
_MAX_BACKOFF_S = 60.0
_sleep = asyncio.sleep  # tests record the back-off instead of sleeping


@dataclass
class ServerOptions:
    servers: list[str]  # base URLs, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    concurrency: int = 32  # conversations in flight per server
    model: str | None = None  # None: the one model that /v1/models lists
    max_retries: int = 5  # per request, after the first try
    timeout: float = 600.0  # seconds per request
    backoff: float = 1.0  # first retry delay in seconds; doubles per retry (with jitter), at most 60 s


class RequestFailed(Exception):
    """A request that cannot succeed (a 4xx answer) or that exhausted its retries."""


def errors_path(output: str | Path) -> Path | None:
    """``OUT.errors.jsonl`` beside a regular output (None for stdout or a special file: failures are
    then warnings on stderr)."""
    if is_stdout(output) or is_special(output):
        return None
    out = Path(output)
    return out.with_name(out.stem + ".errors.jsonl")


class _Client:
    """One httpx client for every server: JSON requests with retries and back-off."""

    def __init__(self, sopts: ServerOptions, transport: httpx.AsyncBaseTransport | None = None):
        self.sopts = sopts
        limits = httpx.Limits(max_connections=sopts.concurrency * len(sopts.servers) + len(sopts.servers))
        self.http = httpx.AsyncClient(timeout=sopts.timeout, limits=limits, transport=transport)

    async def request(self, method: str, url: str, body: dict | None = None, *, retries: int | None = None) -> dict:
        """The decoded JSON answer; raises RequestFailed naming the last problem."""
        retries = self.sopts.max_retries if retries is None else retries
        problem = "no attempt"  # retries >= 0: every attempt names its problem
        for attempt in range(retries + 1):
            wait = None
            try:
                resp = await self.http.request(method, url, json=body)
            except httpx.TimeoutException:
                problem = f"timed out after {self.sopts.timeout:g} s"
            except httpx.TransportError as exc:
                problem = f"unreachable ({_first_line(exc) or type(exc).__name__})"
            else:
                if resp.status_code < 400:
                    try:
                        return resp.json()
                    except ValueError:
                        raise RequestFailed(f"{url}: answer is not JSON") from None
                problem = f"HTTP {resp.status_code}: {_detail(resp)}"
                if resp.status_code not in RETRY_STATUS:
                    raise RequestFailed(problem)
                wait = _retry_after(resp)
            if attempt == retries:
                break
            delay = min(_MAX_BACKOFF_S, self.sopts.backoff * 2**attempt) * random.uniform(0.5, 1.0)
            await _sleep(wait if wait is not None else delay)
        raise RequestFailed(problem + (f" ({retries + 1} tries)" if retries else ""))


def _retry_after(resp: httpx.Response) -> float | None:
    try:
        return min(_MAX_BACKOFF_S, max(0.0, float(resp.headers["retry-after"])))
    except (KeyError, ValueError):
        return None


def _load_tokenizer(target: str | None):
    """--target's tokenizer and context length (config only: the weights stay on the servers)."""
    from transformers import AutoConfig, AutoTokenizer

    name = target or str(DEFAULT_TARGET_PATH)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        config = AutoConfig.from_pretrained(name).get_text_config()
    except (OSError, ValueError) as err:
        raise DspecError(f"cannot load the tokenizer of target {name!r}: {_first_line(err)}") from err
    if tokenizer.chat_template is None:
        raise DspecError("the target's tokenizer has no chat template; regeneration needs a chat model")
    return tokenizer, max_context(config)


class _Regeneration:
    def __init__(self, opts: RegenerateOptions, sopts: ServerOptions, stats: RegenerateStats, out: Path,
                 client: _Client, tick: Callable[[int], None]):
        self.opts, self.sopts, self.stats, self.out, self.client, self.tick = opts, sopts, stats, out, client, tick
        self.tokenizer, self.max_ctx = _load_tokenizer(opts.target)
        self.model = sopts.model

    def render(self, messages: list[dict]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **self.opts.chat_template_kwargs
        ))

    def body(self, messages: list[dict], max_tokens: int, seed: int) -> dict:
        o = self.opts
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": o.temperature,
                "top_p": o.top_p, "seed": seed}
        if o.top_k > 0:
            body["top_k"] = o.top_k  # vLLM / SGLang extension; 0 leaves it out (servers that reject it)
        if o.chat_template_kwargs:
            body["chat_template_kwargs"] = o.chat_template_kwargs
        return body

    async def check(self, server: str) -> None:
        """Reachable, serving the model, tokenizing like --target; a one-line DspecError otherwise."""
        try:
            listing = await self.client.request("GET", f"{server}/v1/models", retries=0)
        except RequestFailed as exc:
            raise DspecError(f"server {server}: {exc}; is it running (see docs/training.md)?") from None
        ids = [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)]
        if self.model is None:
            if len(ids) != 1:
                raise DspecError(f"server {server} serves {len(ids)} models ({', '.join(map(str, ids))}); pass --model")
            self.model = ids[0]
        elif self.model not in ids:
            raise DspecError(f"server {server} does not serve {self.model!r} (it serves {', '.join(map(str, ids))})")
        messages = [{"role": "user", "content": PROBE}]
        try:
            answer = await self.client.request("POST", f"{server}/v1/chat/completions", self.body(messages, 1, 0))
        except RequestFailed as exc:
            hint = "; pass --top-k 0 if it rejects top_k" if "top_k" in str(exc) else ""
            raise DspecError(f"server {server} rejected a probe request: {exc}{hint}") from None
        served = (answer.get("usage") or {}).get("prompt_tokens")
        ours = len(self.render(messages))
        if served is None:
            raise DspecError(f"server {server}: its answers carry no usage.prompt_tokens; cannot check its tokenizer")
        if served != ours:
            raise DspecError(
                f"server {server} serves another tokenizer or chat template than --target "
                f"{self.opts.target or 'embedded tiny target'!r}: a probe prompt is {served} tokens there, {ours} here"
            )

    async def dialogue(self, server: str, conv: Conversation) -> Dialogue:
        d, o = Dialogue(conv), self.opts
        active = d.next_turn()
        while active:
            n_prompt = len(self.render(d.history))
            if self.max_ctx and n_prompt + o.max_new_tokens > self.max_ctx:
                d.history.pop()  # this user turn cannot be answered within the context
                self.stats.shortened += d.answered > 0
                self.stats.skipped += d.answered == 0
                break
            answer = await self.client.request(
                "POST", f"{server}/v1/chat/completions", self.body(d.history, o.max_new_tokens, turn_seed(o.seed, d.id, d.turn))
            )
            try:
                choice = answer["choices"][0]
                message = choice["message"]
                content = message["content"] or ""
            except (KeyError, IndexError, TypeError):
                raise RequestFailed(f"answer has no choices[0].message.content: {str(answer)[:200]}") from None
            if any(message.get(key) for key in REASONING_FIELDS):
                raise DspecError(
                    f"server {server} returns the thinking apart from the answer (message.reasoning_content): "
                    "restart it without --reasoning-parser, so answers keep the text the target generated"
                )
            d.history.append({"role": "assistant", "content": content})
            d.truncated |= choice.get("finish_reason") == "length"
            d.turn += 1
            self.stats.turns += 1
            self.stats.generated_tokens += int((answer.get("usage") or {}).get("completion_tokens") or 0)
            active = d.next_turn()
        return d

    async def run(self, todo: list[Conversation]) -> None:
        servers = [base_url(s) for s in self.sopts.servers]
        for server in servers:
            await self.check(server)
        queue: asyncio.Queue[Conversation] = asyncio.Queue()
        for conv in todo:
            queue.put_nowait(conv)
        errors = errors_path(self.out)
        with open_append(self.out) as f, open(errors or os.devnull, "w", encoding="utf-8") as errf:

            async def worker(server: str) -> None:
                while not queue.empty():
                    conv = queue.get_nowait()
                    before = self.stats.generated_tokens
                    try:
                        d = await self.dialogue(server, conv)
                    except RequestFailed as exc:
                        self.stats.failed += 1
                        write_line(errf, {"id": conv.id, "server": server, "error": str(exc)})
                        errf.flush()
                        if errors is None:  # no errors file beside stdout or a special file
                            warnings.warn(f"{conv.id}: {exc}", stacklevel=1)
                    else:
                        if d.answered:
                            write_line(f, d.record(self.opts.chat_template_kwargs))
                            f.flush()
                            self.stats.written += 1
                            self.stats.truncated += d.truncated
                    self.tick(self.stats.generated_tokens - before)

            tasks = [asyncio.ensure_future(worker(s)) for s in servers for _ in range(self.sopts.concurrency)]
            try:
                await asyncio.gather(*tasks)
            finally:  # an error in one worker stops the others before the files close
                for task in tasks:
                    task.cancel()
        if not self.stats.failed:
            if errors is not None:
                errors.unlink()


def regenerate_with_servers(
    opts: RegenerateOptions,
    sopts: ServerOptions,
    progress: Callable[[int], Callable[[int], None]] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> RegenerateStats:
    """Regenerate ``opts.prompts`` into ``opts.output`` through ``sopts.servers`` (module docstring).

    ``progress(total_conversations)`` returns a callback called once per finished (or failed)
    conversation with the tokens it generated. ``transport``: an httpx transport (tests).
    """
    if not sopts.servers:
        raise DspecError("give at least one --server")
    if sopts.concurrency < 1:
        raise DspecError(f"--server-concurrency must be >= 1, got {sopts.concurrency}")
    if sopts.max_retries < 0:
        raise DspecError(f"--max-retries must be >= 0, got {sopts.max_retries}")
    for s in sopts.servers:
        base_url(s)
    out, stats, todo = plan(opts)
    errors = errors_path(out)
    if errors is not None and errors.exists() and (n := sum(1 for _, line in split_lines(errors.read_text(encoding="utf-8")) if line.strip())):
        stats.notes.append(f"retrying {n} conversation(s) that failed last time (listed in {errors})")
    if not todo:
        return stats
    tick = progress(len(todo)) if progress else (lambda _tokens: None)
    t0 = time.perf_counter()

    async def main() -> None:
        client = _Client(sopts, transport)
        try:
            await _Regeneration(opts, sopts, stats, out, client, tick).run(todo)
        finally:
            await client.http.aclose()

    try:
        asyncio.run(main())
    finally:
        stats.seconds = time.perf_counter() - t0
    return stats

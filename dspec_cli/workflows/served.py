"""A serving engine behind an OpenAI-compatible API, as ``dspec bench --server`` reads it.

Requests go to ``POST /v1/completions`` with the prompt as token ids (rendered here with the
target's chat template, so both servers and dspec's engine see the same tokens); a request ends at
the target's end-of-sequence token or after ``max_tokens``, as in dspec's engine. ``return_token_ids``
asks vLLM for the generated ids (engines without it: the text is tokenized here, which the JSON
notes).

Acceptance comes from the server's Prometheus endpoint (``GET /metrics``):

* vLLM (``vllm/v1/spec_decode/metrics.py``): counters ``vllm:spec_decode_num_drafts``,
  ``…_num_draft_tokens``, ``…_num_accepted_tokens`` and ``…_num_accepted_tokens_per_pos``
  (label ``position``), present only when the server speculates. τ over a run is 1 + accepted /
  drafts of the counters' increase.
* SGLang (``python/sglang/srt/metrics/collector.py``, with ``--enable-metrics``): gauges
  ``sglang:spec_accept_length`` (mean accepted length of the latest logging interval, bonus
  included) and ``sglang:spec_accept_rate``. No per-position counters: τ is the gauge read
  after the run, and acceptance by position is not available.

The library for the exposition format is ``prometheus_client`` (its text parser).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from dspec_cli.core.errors import DspecError
from dspec_cli.core.http import base_url, error_detail, first_line

VLLM_PREFIX = "vllm:spec_decode_num_"
VLLM_PER_POSITION = "accepted_tokens_per_pos"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"


@dataclass(frozen=True)
class SpecCounters:
    """A server's speculative-decoding metrics at one moment (or their increase over a run)."""

    speculating: bool = False  # the server exposes spec-decode metrics at all
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: tuple[float, ...] = ()  # accepted drafts at position 0, 1, ... (vLLM)
    accept_length: float | None = None  # SGLang's gauge (a level, not a counter)

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        n = max(len(self.per_position), len(before.per_position))
        pad = lambda t: tuple(t) + (0.0,) * (n - len(t))  # noqa: E731
        return SpecCounters(
            self.speculating, self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            tuple(a - b for a, b in zip(pad(self.per_position), pad(before.per_position), strict=True)),
            self.accept_length,
        )

    def acceptance(self) -> dict:
        """τ (committed tokens per verification round, bonus included), the drafts per round, and
        acceptance by position as ``dspec bench`` reports them: cond_accept[k] among rounds that
        accepted positions < k, survival[k] among all rounds (every vLLM round verifies its whole
        draft)."""
        if self.drafts > 0:
            reach = (self.drafts, *self.per_position[:-1])
            return {
                "rounds": int(self.drafts),
                "tau": 1 + self.accepted / self.drafts,
                "mean_verified": self.draft_tokens / self.drafts,
                "cond_accept": [a / r if r else None for a, r in zip(self.per_position, reach, strict=True)],
                "survival": [a / self.drafts for a in self.per_position],
            }
        tau = self.accept_length if self.accept_length else None
        return {"rounds": None, "tau": tau, "mean_verified": None, "cond_accept": [], "survival": []}


def parse_metrics(text: str) -> SpecCounters:
    """The spec-decode metrics of a Prometheus text page, summed over label sets (engines,
    models); a page without any: ``SpecCounters(speculating=False)``."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    positions: dict[int, float] = {}
    found, length = False, None
    try:
        samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    except ValueError as exc:
        raise ValueError(f"not Prometheus text ({first_line(exc)})") from None
    for s in samples:
        if s.name == SGLANG_ACCEPT_LENGTH:
            found, length = True, float(s.value)
        if not s.name.startswith(VLLM_PREFIX) or not s.name.endswith("_total"):
            continue
        found = True
        key = s.name[len(VLLM_PREFIX): -len("_total")]
        if key == VLLM_PER_POSITION:
            pos = int(s.labels.get("position", 0))
            positions[pos] = positions.get(pos, 0.0) + float(s.value)
        else:
            totals[key] = totals.get(key, 0.0) + float(s.value)
    per_position = tuple(positions.get(k, 0.0) for k in range(max(positions) + 1)) if positions else ()
    return SpecCounters(speculating=found, drafts=totals.get("drafts", 0.0), draft_tokens=totals.get("draft_tokens", 0.0),
                        accepted=totals.get("accepted_tokens", 0.0), per_position=per_position, accept_length=length)


@dataclass
class Completion:
    """One served request: its generated ids, how long it took, and whether ids were tokenized here."""

    tokens: list[int]
    seconds: float
    retokenized: bool = False


@dataclass
class Endpoint:
    """One OpenAI-compatible server, named in errors by the option that gave it."""

    url: str
    option: str
    http: httpx.AsyncClient
    model: str | None = None
    engine: str = "server"  # /v1/models owned_by: "vllm", "sglang", ...
    version: str | None = None
    max_model_len: int | None = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.url = base_url(self.url, self.option)

    @property
    def where(self) -> str:
        return f"{self.option} {self.url}"

    @property
    def name(self) -> str:
        return f"{self.engine} {self.version}" if self.version else self.engine

    async def call(self, method: str, path: str, body: dict | None = None, *, text: bool = False) -> Any:
        """The answer's JSON (or text); a one-line DspecError naming the server otherwise."""
        try:
            resp = await self.http.request(method, self.url + path, json=body)
        except httpx.TimeoutException:
            raise DspecError(f"{self.where}: {path} timed out") from None
        except httpx.TransportError as exc:
            raise DspecError(f"{self.where}: unreachable ({first_line(exc) or type(exc).__name__}); "
                             "is the server running?") from None
        if resp.status_code >= 400:
            raise ServerAnswer(resp.status_code, f"{self.where}: {method} {path} answered HTTP {resp.status_code}: "
                                                 f"{error_detail(resp)}")
        if text:
            return resp.text
        try:
            return resp.json()
        except ValueError:
            raise DspecError(f"{self.where}: {path} answered with something that is not JSON") from None

    async def connect(self, model: str | None) -> None:
        """The model to request (the one /v1/models lists, or ``model``), the engine and its version."""
        listing = await self.call("GET", "/v1/models")
        entries = [m for m in listing.get("data", []) if isinstance(m, dict)] if isinstance(listing, dict) else []
        ids = [str(m.get("id")) for m in entries]
        if model is None and len(ids) != 1:
            raise DspecError(f"{self.where} serves {len(ids)} models ({', '.join(ids) or 'none'}); pass --server-model")
        if model is not None and model not in ids:
            raise DspecError(f"{self.where} does not serve {model!r} (it serves {', '.join(ids) or 'nothing'})")
        entry = entries[ids.index(model)] if model is not None else entries[0]
        self.model = str(entry["id"])
        self.engine = str(entry.get("owned_by") or "server")
        self.max_model_len = entry.get("max_model_len") if isinstance(entry.get("max_model_len"), int) else None
        try:
            version = await self.call("GET", "/version")
            self.version = str(version.get("version")) if isinstance(version, dict) and version.get("version") else None
        except DspecError:
            self.version = None  # engines without /version (SGLang: /get_server_info)

    async def metrics(self) -> SpecCounters:
        try:
            text = await self.call("GET", "/metrics", text=True)
        except ServerAnswer as exc:
            raise DspecError(f"{self.where}: no metrics endpoint (GET /metrics answered HTTP {exc.status}): τ is read "
                             "from the engine's speculative-decoding counters (vLLM serves them unless started with "
                             "--disable-log-stats; SGLang needs --enable-metrics)") from None
        try:
            return parse_metrics(text)
        except ValueError as exc:
            raise DspecError(f"{self.where}: /metrics is {exc}") from None

    async def prompt_tokens(self, text: str) -> int | None:
        """How many tokens the server counts in ``text`` as a completion prompt (``usage.prompt_tokens``)."""
        answer = await self.call("POST", "/v1/completions", {"model": self.model, "prompt": text, "max_tokens": 1,
                                                              "temperature": 0})
        count = (answer.get("usage") or {}).get("prompt_tokens") if isinstance(answer, dict) else None
        return count if isinstance(count, int) else None

    async def complete(self, prompt: list[int], sampling: dict, seed: int, tokenize=None) -> Completion:
        """Generate up to ``sampling["max_tokens"]`` tokens after ``prompt`` (ids) with ``seed``
        (``sampling``: the request's sampling fields, e.g. ``ignore_eos``); ``tokenize(text)`` gives
        ids when the engine returns text only."""
        body = {"model": self.model, "prompt": prompt, "seed": seed, "return_token_ids": True, **sampling}
        t0 = time.perf_counter()
        answer = await self.call("POST", "/v1/completions", body)
        seconds = time.perf_counter() - t0
        try:
            choice = answer["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise DspecError(f"{self.where}: a completion answer has no choices[0]: {str(answer)[:200]}") from None
        ids = choice.get("token_ids")
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            return Completion(list(ids), seconds)
        if tokenize is None or not isinstance(choice.get("text"), str):
            raise DspecError(f"{self.where}: a completion answer has neither token_ids nor text")
        return Completion(list(tokenize(choice["text"])), seconds, retokenized=True)


class ServerAnswer(DspecError):
    """An HTTP error answer (the status kept, for callers that explain some statuses)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status

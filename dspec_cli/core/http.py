"""Talking to OpenAI-compatible servers (vLLM, SGLang, TGI, ``transformers serve``): base URLs,
one-line reasons for failed requests, and the probe text that checks a server tokenizes like the
target (used by ``dspec data regenerate --server`` and ``dspec bench --server``)."""

from __future__ import annotations

import httpx

from dspec_cli.core.errors import DspecError

PROBE = (
    "Probe 1: the quick brown fox jumps over 13 lazy dogs; 3.14159 × 2 = 6.28318. "
    "def f(x):\n    return x ** 2  # ok\n"
    "Über straße, façade, naïve — 你好，世界！こんにちは。Привет, мир! 🙂 <b>tags</b> & {json: [1, 2]}"
)


def base_url(url: str, option: str = "--server") -> str:
    """``url`` without a trailing slash or ``/v1``; DspecError naming ``option`` unless http(s)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise DspecError(f"{option} {url!r}: expected an http:// or https:// URL")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def error_detail(resp: httpx.Response) -> str:
    """The server's reason for an error answer, in one line (its JSON ``error.message`` / ``detail``)."""
    try:
        body = resp.json()
    except ValueError:
        return (resp.text.strip().splitlines() or [resp.reason_phrase])[0][:300]
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message", body)))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err).splitlines()[0][:300] if str(err) else resp.reason_phrase
    return str(body)[:300]

"""Chat-template keyword arguments: how conversations are rendered for the target.

One setting, passed to ``tokenizer.apply_chat_template`` wherever dspec renders a conversation
(prompts of bench and calibrate, regeneration, training text) and sent as ``chat_template_kwargs``
to servers. Reasoning models switch modes with it: Qwen3's template takes ``enable_thinking``
(true: the model thinks first; false: its generation prompt closes an empty think block). The
default is Qwen3's non-thinking mode; templates that do not use a key ignore it.

A drafter learns the target's answers in the mode its training data was rendered in, and accepts
far less on traffic of another mode, so what dspec makes records the kwargs it was made under
(``chat_template_kwargs`` in a checkpoint's config.json, in every line ``dspec data regenerate``
writes, in calibration.json), and :func:`warn_if_other` warns when such a thing is used under
others that the target's template renders differently.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from dspec_cli.core.errors import DspecError
from dspec_cli.core.records import check_tree, parse_json

DEFAULT_KWARGS: Mapping[str, Any] = MappingProxyType({"enable_thinking": False})  # Qwen3's non-thinking mode
OPTION = "--chat-template-kwargs"


def default_kwargs() -> dict[str, Any]:
    """A fresh copy of :data:`DEFAULT_KWARGS`."""
    return dict(DEFAULT_KWARGS)


# names the chat-template call sets itself: transformers' ``apply_chat_template`` parameters and the
# variables its renderer passes to the template (``messages``); one of them among the kwargs is
# refused, naming where it came from (tests/test_chat_template.py checks the list against transformers)
RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def check_kwargs(value: Any, where: str) -> dict[str, Any]:
    """``value`` as a kwargs dict: an object with string keys and plain JSON values (finite
    numbers, no lone surrogate, bounded depth: :func:`~dspec_cli.core.records.check_tree`), none of
    them a :data:`RESERVED` name; DspecError naming ``where`` and the key otherwise."""
    if not isinstance(value, Mapping):
        raise DspecError(f"{where} must be a JSON object / TOML table, e.g. {{\"enable_thinking\": true}}, got {value!r}")
    check_tree(dict(value), where)
    reserved = sorted(RESERVED & set(value))
    if reserved:
        verb = "is a name" if len(reserved) == 1 else "are names"
        raise DspecError(f"{where}: {', '.join(reserved)} {verb} the chat-template call sets itself, not a template "
                         "keyword argument; remove it")
    return dict(value)


def parse_kwargs(text: str, where: str = OPTION) -> dict[str, Any]:
    """The JSON object ``text`` (e.g. ``'{"enable_thinking": true}'``, ``'{}'``), checked."""
    return check_kwargs(parse_json(text, where), where)


def describe(kwargs: Mapping[str, Any]) -> str:
    """Compact JSON, keys sorted: what messages and model cards show, and what shell commands pass."""
    return json.dumps(dict(kwargs), sort_keys=True)


def mode(kwargs: Mapping[str, Any]) -> str:
    """ "thinking" / "non-thinking" when ``enable_thinking`` is set, else "" (the template's own default)."""
    flag = kwargs.get("enable_thinking")
    return "" if not isinstance(flag, bool) else ("thinking" if flag else "non-thinking")


def renders_alike(tokenizer, a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether ``tokenizer``'s chat template renders a probe conversation (an earlier answer with
    a think block, then a generation prompt) the same under kwargs ``a`` and ``b``: a template that
    reads none of the keys that differ."""
    if dict(a) == dict(b):
        return True
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        return False
    return _probe(tokenizer, a) == _probe(tokenizer, b)


def _probe(tokenizer, kwargs: Mapping[str, Any]) -> str:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"},
                {"role": "user", "content": "And?"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def warn_if_other(made: str, recorded: Mapping[str, Any] | None, used: Mapping[str, Any], tokenizer=None,
                  effect: str = "it accepts less under other ones", stacklevel: int = 2) -> None:
    """A one-line warning when something ``made`` under ``recorded`` kwargs (e.g. "drafter dspark was
    trained"; None: not recorded) is used under ``used`` and the target's chat template
    (``tokenizer``'s) renders them differently; ``effect`` says what that costs. ``stacklevel``
    (:func:`warnings.warn`'s): the caller it is reported for, shown once per caller and text."""
    if recorded is None or renders_alike(tokenizer, recorded, used):
        return
    label = mode(recorded)
    warnings.warn(
        f"{made} with chat-template kwargs {describe(recorded)}" + (f" ({label} mode)" if label else "")
        + f", not {describe(used)}: {effect} (pass {OPTION} '{describe(recorded)}' to match)",
        stacklevel=stacklevel,
    )

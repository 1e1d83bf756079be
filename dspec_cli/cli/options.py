"""The options every command shares: one name, one meaning, one type, one help text (docs/cli.md)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import typer

from dspec_cli.core.chat_template import (
    DEFAULT_KWARGS,
    default_kwargs,
    describe,
    parse_kwargs,
)
from dspec_cli.core.errors import DspecError
from dspec_cli.core.records import MAX_BLOCK, MAX_CONCURRENCY, MAX_TOKENS

MAX_COUNT = 2**31 - 1  # counts (prompts, steps, repeats): beyond this a value is a typo
MAX_SEED = 2**32 - 1  # seeds are 32-bit: every random stream is keyed by (seed, offset, salt) in 64 bits


def int_option(default: int | None, *decls: str, minimum: int, maximum: int = MAX_COUNT, **kwargs: Any) -> Any:
    """An integer option with its range (a usage error outside it, before anything loads); every
    integer option of every command is one (tests/test_cli_bad_input.py checks)."""
    return typer.Option(default, *decls, min=minimum, max=maximum, **kwargs)


def target(what: str = "Target model",
           default: str = "the target the checkpoint was trained for, else the embedded tiny target") -> Any:
    return typer.Option(None, "--target", metavar="PATH|HUB_ID", help=f"{what}: local folder or Hub id (default: {default}).")


def dataset(*aliases: str) -> Any:
    return typer.Option([], "--dataset", *aliases, metavar="FILE|builtin",
                        help="Prompt file (repeatable): jsonl of {\"turns\": [...]}, ShareGPT {\"conversations\": [...]} "
                             "or {\"messages\": [...]} lines, or 'builtin' (default: the built-in prompts).")


def num_prompts() -> Any:
    return int_option(None, "--num-prompts", minimum=1, help="Use the first N prompts of each dataset (default: all).")


def max_new_tokens(default: int | None, help: str = "Most tokens generated per prompt (>= 1).") -> Any:
    return int_option(default, "--max-new-tokens", minimum=1, maximum=MAX_TOKENS, help=help)


def block_size(default: int | None, help: str) -> Any:
    return int_option(default, "--block-size", minimum=1, maximum=MAX_BLOCK, help=help)


def finite_float(text: str | float) -> float:
    """The parser of every float option: a number, and NaN or infinity refused (a usage error)."""
    try:
        value = float(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise typer.BadParameter(f"{text!r} is not a finite number")
    return value


def float_option(default: float | None, *decls: str, **kwargs: Any) -> Any:
    """A float option: ``typer.Option`` with :func:`finite_float` as its parser and metavar FLOAT."""
    return typer.Option(default, *decls, parser=finite_float, metavar="FLOAT", **kwargs)


def temperature(default: float = 1.0) -> Any:
    return float_option(default, "--temperature", help="Sampling temperature, >= 0 (0 = greedy).")


def top_p(default: float = 1.0) -> Any:
    return float_option(default, "--top-p", help="Nucleus sampling mass in (0, 1] (1 = off).")


def top_k(default: int | None = 0, help: str = "Sample from the K most likely tokens, >= 0 (0 = off).") -> Any:
    return int_option(default, "--top-k", minimum=0, help=help)


def seed(default: int | None = 0, help: str = "Random seed, 0 <= S < 2^32: the same seed gives the same tokens.") -> Any:
    return int_option(default, "--seed", minimum=0, maximum=MAX_SEED, help=help)


def chat_template_kwargs(recipe: bool = False) -> Any:
    default = ("the recipe's chat_template table, else " if recipe else "") + describe(DEFAULT_KWARGS)
    return typer.Option(None, "--chat-template-kwargs", metavar="JSON",
                        help="Keyword arguments of the target's chat template, a JSON object, e.g. "
                             "'{\"enable_thinking\": true}' for Qwen3's thinking mode; '{}' passes none "
                             f"(default: {default}).")


def template_kwargs(text: str | None) -> dict[str, Any]:
    """--chat-template-kwargs parsed and checked (bad JSON is a one-line error); the default when not given."""
    return default_kwargs() if text is None else parse_kwargs(text)


def device() -> Any:
    return typer.Option("auto", "--device", metavar="DEVICE",
                        help="auto (cuda when available, else cpu), cpu, cuda or cuda:N.")


def cuda_graphs() -> Any:
    return typer.Option(True, "--cuda-graphs/--no-cuda-graphs",
                        help="On a CUDA device, run each round's device work as CUDA graphs captured per shape "
                             "bucket (the default); --no-cuda-graphs runs it op by op. CPUs always run op by op.")


def compile_rounds() -> Any:
    return typer.Option(False, "--compile/--no-compile",
                        help="Compile each round's device work with torch.compile (on a CPU inductor's C++ code: "
                             "several times fewer operator calls per step, about 1.3-1.8x faster decoding of a small "
                             "target once compiled; the first rounds compile for one to several minutes, cached on "
                             "disk by torch's inductor cache). The baseline is compiled too.")


def batch_invariant() -> Any:
    return typer.Option(None, "--batch-invariant/--no-batch-invariant", show_default=False,
                        help="Verify with batch-invariant target forwards: a token's logits are the same in a verify "
                             "as in a plain step, so at T = 0 every drafter gives plain decoding's output. Default: "
                             "on where it is free (compiled rounds of 8 or more rows), else fused attention; it "
                             "applies where dspec's own forward runs (the Llama family and the embedded target on "
                             "a CPU), elsewhere it is an error (docs/verification.md, \"Precision\").")


def dtype() -> Any:
    return typer.Option("auto", "--dtype", metavar="DTYPE",
                        help="auto (bfloat16 on CUDA and on CPUs with native bf16, else float32), float32, "
                             "bfloat16 or float16.")


def json_path(what: str) -> Any:
    return typer.Option(None, "--json", metavar="PATH|-", help=f"Write {what} as JSON to PATH ('-': stdout).")


def plots(what: str) -> Any:
    return typer.Option(None, "--plots", metavar="DIR", help=f"Write PNG figures into DIR: {what}.")


def strict(what: str) -> Any:
    return typer.Option(False, "--strict", help=f"Make {what} an error instead of a warning.")


def overwrite(what: str) -> Any:
    return typer.Option(False, "--overwrite", help=f"Replace {what} (otherwise an existing one is an error).")


def concurrency_list(default: str) -> Any:
    return typer.Option(default, "--concurrency", metavar="R[,R...]",
                        help=f"Concurrent requests, one run per value, e.g. 1,4,16 (default {default}).")


def concurrency(default: int | None, help: str | None = None) -> Any:
    return int_option(default, "--concurrency", minimum=1, maximum=MAX_CONCURRENCY, metavar="R",
                      help=help or f"Concurrent requests (default {default}).")


def int_list(text: str, option: str, minimum: int = 1, maximum: int = MAX_COUNT) -> list[int]:
    """Parse "1,4,16" for ``option``; every value must lie in [minimum, maximum]."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DspecError(f"{option} must be a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise DspecError(f"{option} values must be >= {minimum}, got {text!r}")
    if any(v > maximum for v in values):
        raise DspecError(f"{option} values must be <= {maximum}, got {text!r}")
    return values


def trace_files(path: Path | None) -> list[Path]:
    """A --traces path and the SGLang STS shards of a collection stem (``<stem>.N.pt``): what the run reads."""
    if path is None:
        return []
    return [path, *sorted(path.parent.glob(f"{path.name}.*.pt"))]


def typed(ctx: typer.Context, *names: str) -> list[str]:
    """The options among parameters ``names`` that the user gave (on the command line or in the
    environment), by their long names: an option given where it cannot apply is an error, never
    silently ignored. An on/off flag is named as given (``--no-cuda-graphs``)."""
    given = []
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name) if param.name in names else None
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            off = getattr(param, "secondary_opts", None) and ctx.params.get(param.name) is False
            opts = param.secondary_opts if off else param.opts
            given.append(next((o for o in opts if o.startswith("--")), opts[0]))
    return given


def refuse(ctx: typer.Context, names: tuple[str, ...], here: str, applies: str) -> None:
    """DspecError when the user gave any option of ``names`` (parameter names), which have no
    effect ``here`` (e.g. "without --drafter"); ``applies``: where they do (e.g. "with --drafter")."""
    given = typed(ctx, *names)
    if given:
        one = len(given) == 1
        raise DspecError(f"{', '.join(given)} {'has' if one else 'have'} no effect {here}: "
                         f"{'it applies' if one else 'they apply'} {applies}")


def wrote(console, path: str | Path | None) -> None:
    """Say on stderr that ``path`` was written (nothing for stdout)."""
    if path is not None:
        console.print(f"wrote {path}", highlight=False, soft_wrap=True)

"""The ``dspec`` command line: a Typer app, one module per command, errors as one line."""

from __future__ import annotations

import os
import sys
import warnings

import typer

from dspec_cli.core.errors import DspecError
from dspec_cli.core.locks import release_all
from dspec_cli.core.process_exit import exit_now, exit_without_finalization_requested

app = typer.Typer(
    name="dspec",
    help="Train, calibrate, profile, benchmark and publish speculative-decoding drafters.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # --install-completion, --show-completion (bash, zsh, fish, PowerShell)
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True),
) -> None:
    """dspec: speculative decoding drafters for Hugging Face causal LMs."""
    if version:
        from dspec_cli.core.version import __version__

        print(__version__)
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit()


def _register_commands() -> None:
    """Each command module registers its command on import (one module per command; they import
    their workflow inside the command, so this loads neither torch nor transformers)."""
    from dspec_cli.cli import (  # noqa: F401
        bench,
        calibrate,
        data,
        datasets,
        drafters,
        export,
        profile,
        push,
        schedule,
        train,
    )


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: user errors print one line to stderr and exit non-zero."""
    # our own progress bars replace the libraries' (weight loading, downloads)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_VERBOSITY", "error")  # e.g. retry notices: errors arrive as one line
    if "transformers" in sys.modules:  # already imported (in-process use): switch them off directly
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import logging as hub_logging

        hub_logging.set_verbosity_error()
    _register_commands()
    shown = warnings.showwarning
    warnings.showwarning = show_warning
    try:
        code = _run(argv)
    finally:
        warnings.showwarning = shown
        release_all()  # the output locks of core/run_paths.py
    if code == INTERRUPTED:
        print("Interrupted", file=sys.stderr)
    code = code if isinstance(code, int) else 0
    if exit_without_finalization_requested():
        exit_now(code)
    if code:
        sys.exit(code)


def _run(argv: list[str] | None) -> int | None:
    """The command's exit code; user errors are reported here as one line."""
    try:
        return app(args=argv, prog_name="dspec", standalone_mode=False)  # Typer turns Ctrl-C into a returned 130
    except typer.Exit as exc:
        return exc.exit_code
    except KeyboardInterrupt:
        return INTERRUPTED
    except typer.Abort:  # end of input at a prompt
        print("Aborted", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the one place that turns errors into a line
        if os.environ.get("DSPEC_DEBUG"):
            raise
        return _report(exc)


INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Every warning as one ``Warning: ...`` line on stderr (no file and line of the source)."""
    text = str(message).strip().splitlines()
    print(f"Warning: {text[0] if text else category.__name__}", file=sys.stderr if file is None else file)


def _report(exc: BaseException) -> int:
    if isinstance(exc, typer.TyperException) and hasattr(exc, "format_message"):
        ctx = getattr(exc, "ctx", None)  # usage errors: Click's message and where the options are listed
        hint = f" (see '{ctx.command_path} -h')" if ctx is not None else ""
        print(f"Error: {exc.format_message().rstrip('.')}{hint}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    if isinstance(exc, DspecError | ValueError | FileNotFoundError | OSError):
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"Error: {msg}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    print(f"Error: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}", file=sys.stderr)
    print("Hint: set DSPEC_DEBUG=1 for the full traceback.", file=sys.stderr)
    return 1

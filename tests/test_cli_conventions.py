"""Command-line conventions: -h, help text on every option, one option vocabulary, progress lines
in logs, warnings as one line, Ctrl-C as exit 130, help without loading the model libraries."""

from __future__ import annotations

import io
import subprocess
import sys
import warnings

import pytest
import typer
from rich.console import Console
from tiny_models import run_cli

from dspec_cli.cli import _register_commands, app, main, show_warning
from dspec_cli.cli.progress import CommandProgress, LogLines


def _commands() -> dict:
    _register_commands()
    root = typer.main.get_command(app)
    out = {}
    for name, cmd in root.commands.items():
        for sub, leaf in getattr(cmd, "commands", {name: cmd}).items():
            out[name if sub == name else f"{name} {sub}"] = leaf
    return out


def _options(cmd) -> dict:
    """--name -> option of a command (Typer ships its own copy of Click: matched by kind, not class)."""
    return {name: p for p in cmd.params if p.param_type_name == "option" for name in p.opts if name.startswith("--")}


def test_every_option_has_help():
    assert sum(len(_options(cmd)) for cmd in _commands().values()) > 80
    missing = [f"{c} {n}" for c, cmd in _commands().items() for n, p in _options(cmd).items()
               if n != "--help" and not (p.help or "").strip()]
    assert missing == []


@pytest.mark.parametrize("name", ["--json", "--plots", "--device", "--dtype", "--seed", "--dataset", "--target"])
def test_shared_options_mean_the_same_everywhere(name):
    """Same name: same type, same metavar, same multiplicity in every command that has it (schedule's
    --device and --target only name what a cost table is compared with)."""
    seen = {c: _options(cmd)[name] for c, cmd in _commands().items() if name in _options(cmd)}
    if name in ("--device", "--target"):
        seen.pop("schedule", None)
    kinds = {c: (str(p.type_descriptor.annotation).removeprefix("typing.Optional["), p.metavar, p.multiple, p.is_flag)
             for c, p in seen.items()}
    assert len(seen) >= 2 and len(set(kinds.values())) == 1, kinds


def test_list_valued_concurrency_where_several_runs_make_sense():
    cmds = _commands()
    for c in ("bench", "schedule"):
        assert _options(cmds[c])["--concurrency"].metavar == "R[,R...]"


def test_short_help_flag(capsys):
    code, out, _ = run_cli(["bench", "-h"], capsys)
    assert code == 0 and "--device" in out and "cuda:N" in out
    code, out, _ = run_cli(["-h"], capsys)
    assert code == 0 and "bench" in out


def test_progress_lines_in_logs():
    buf = io.StringIO()
    with CommandProgress(Console(file=buf, force_terminal=False, width=80), unit="requests", interval=0) as bar:
        task = bar.add_task("bench", total=4)
        for _ in range(4):
            bar.advance(task)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 4 and lines[0] == "bench: 1/4"
    assert "requests/s" in lines[1] and "ETA" in lines[1] and "done in" in lines[-1]


def test_progress_lines_wait_for_the_interval():
    buf = io.StringIO()
    lines = LogLines(Console(file=buf, force_terminal=False), interval=3600)
    for done in range(1, 4):
        lines.tick("k", "work", done, 3)
    assert buf.getvalue() == ""  # finished within the interval: nothing to report in a log


def test_warnings_are_one_line():
    buf = io.StringIO()
    show_warning(UserWarning("first line\nsecond"), UserWarning, "x.py", 3, file=buf)
    assert buf.getvalue() == "Warning: first line\n"


def test_warning_inside_a_command_goes_through_the_channel(capsys, monkeypatch):
    from dspec_cli.cli import drafters

    def warn_and_list():
        warnings.warn("plugin x failed to load", stacklevel=1)

    monkeypatch.setattr(drafters.plugins, "registry", lambda: (warn_and_list(), drafters.plugins.Registry())[1])
    code, _, err = run_cli(["drafters"], capsys)
    assert code == 0 and err.splitlines() == ["Warning: plugin x failed to load"]


def test_interrupt_exits_130(capsys, monkeypatch):
    from dspec_cli.cli import drafters

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(drafters.plugins, "registry", interrupted)
    with pytest.raises(SystemExit) as exc:
        main(["drafters"])
    assert exc.value.code == 130 and capsys.readouterr().err == "Interrupted\n"


def test_device_auto_picks_cuda_and_bfloat16_when_present(monkeypatch):
    import torch

    from dspec_cli.core.devices import auto_dtype, resolve_device
    from dspec_cli.core.errors import DspecError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_device("auto") == torch.device("cuda") and auto_dtype(torch.device("cuda")) == torch.bfloat16
    from dspec_cli.core import hardware

    monkeypatch.setattr(hardware, "cpu_native_half", lambda dtype: False)  # e.g. an AVX2-only EPYC
    assert auto_dtype(torch.device("cpu")) == torch.float32
    monkeypatch.setattr(hardware, "cpu_native_half", lambda dtype: dtype == torch.bfloat16)  # AVX512-BF16 / AMX
    assert auto_dtype(torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(hardware, "cpu_native_half", lambda dtype: None)  # not x86 Linux: cannot tell
    assert auto_dtype(torch.device("cpu")) == torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(DspecError, match="--device cuda: .*use --device cpu or auto"):
        resolve_device("cuda")
    with pytest.raises(DspecError, match="unknown device"):
        resolve_device("gpu0")


def test_shell_completion_completes_commands_and_options(capsys, monkeypatch):
    """`dspec --install-completion` installs Typer's completion; the completion answers from the app."""
    for words, cword, expected in (("dspec ben", "1", "bench"), ("dspec bench --temp", "2", "--temperature")):
        monkeypatch.setenv("_DSPEC_COMPLETE", "complete_bash")
        monkeypatch.setenv("COMP_WORDS", words)
        monkeypatch.setenv("COMP_CWORD", cword)
        code, out, _ = run_cli([], capsys)
        assert code == 0 and out.split() == [expected]
    monkeypatch.delenv("_DSPEC_COMPLETE")
    code, out, _ = run_cli(["-h"], capsys)
    assert "--install-completion" in out


def test_help_loads_no_model_library():
    """Command modules import their workflow inside the command: ``dspec --help`` stays fast."""
    code = ("import sys; from dspec_cli.cli import _register_commands; _register_commands(); "
            "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("argv", "code"), [(["--version"], 0), (["train", "--no-such-option"], 2)])
def test_a_process_that_ran_gloo_ends_without_finalization(capsys, monkeypatch, argv, code):
    """After a gloo run, main() flushes and ends through os._exit with the command's exit code
    (gloo's worker threads must not meet a shutting-down interpreter)."""
    from dspec_cli.core import process_exit

    class Exited(BaseException):
        pass

    def fake_exit(status):
        raise Exited(status)

    monkeypatch.setattr(process_exit, "_reason", None)
    monkeypatch.setattr(process_exit.os, "_exit", fake_exit)
    process_exit.request_exit_without_finalization("gloo worker threads outlive the process group")
    with pytest.raises(Exited) as ended:
        main(argv)
    out, err = capsys.readouterr()
    assert ended.value.args == (code,)
    assert (out.strip() and not err) if code == 0 else err.startswith("Error: ")

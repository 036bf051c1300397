"""The Typer application and the one top-level error handler."""

from __future__ import annotations

import os
import sys

import click
import typer
from typer.core import TyperGroup

from lorakit import __version__
from lorakit.cli import STOP as _STOP
from lorakit.cli import bench, cache, convert, demo, doctor, gone, infer, interrupt, push, train, ui
from lorakit.cli.common import emit, err_console, json_requested, use_json
from lorakit.errors import ConfigError, InputError, LorakitError, environment_fault, short

try:  # newer Typer carries its own copy of click: its exceptions are other classes than click's
    from typer._click import exceptions as _typer_click
except ImportError:
    _typer_click = click.exceptions
_CLICKS = (click.exceptions, _typer_click)
_USAGE = tuple({m.UsageError for m in _CLICKS})
_CLICK_EXITS = tuple({getattr(m, n) for m in _CLICKS for n in ("Exit", "ClickException", "Abort") if hasattr(m, n)}
                     | {typer.Exit})


def _debug() -> bool:
    return os.environ.get("LORAKIT_DEBUG", "") not in ("", "0")


def report_error(e: BaseException, as_json: bool) -> int:
    """Show an error in one line (+ hint); return the exit code. Machine faults (disk, permissions, memory,
    missing libraries) are named as such; only what lorakit cannot classify is called a bug."""
    if not isinstance(e, LorakitError):
        e = environment_fault(e) or e
    if isinstance(e, LorakitError):
        code, data = e.exit_code, e.to_dict()
    else:
        code = 1
        data = {"error": type(e).__name__, "message": short(e, 300),
                "hint": "this looks like a bug in lorakit: rerun with LORAKIT_DEBUG=1 and report it with "
                        "the output of `lorakit doctor --json`"}
    if as_json:
        emit(True, data)
        return code
    problems = data.get("problems") or []
    if len(problems) > 1 and isinstance(e, ConfigError):  # a config with several mistakes: one line each
        where = _escape(f" in {e.source}") if getattr(e, "source", None) else ""
        err_console.print(f"[bold red]error:[/] config{where}: {len(problems)} problems", soft_wrap=True)
        for p in problems:
            err_console.print(f"  - {p}", soft_wrap=True, markup=False)
    else:
        err_console.print("[bold red]error:[/] " + _escape(data["message"] or data["error"]), soft_wrap=True)
        for p in problems[1:] if len(problems) > 1 else []:  # the others (files: path, problem, detail)
            err_console.print(f"  - {_problem(p)}", soft_wrap=True, markup=False)
    if data.get("hint"):
        err_console.print("[yellow]hint:[/] " + _escape(data["hint"]), soft_wrap=True)
    return code


def usage_error(e) -> InputError:
    """A command-line usage error as lorakit's bad input: the parser's words (with its "did you mean"), and where
    the usage is explained."""
    ctx = getattr(e, "ctx", None)
    where = ctx.command_path if ctx is not None else "lorakit"
    return InputError(e.format_message(), f"`{where} -h` lists its commands and options")


def _problem(p) -> str:
    """One problem of a list in words: a dataset's {path, code, message} as "path: code: message"."""
    if isinstance(p, dict) and {"path", "code", "message"} <= set(p):
        return f"{p['path']}: {p['code']}: {p['message']}"
    return str(p)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(str(text))


def _interrupted(ctx) -> None:
    """Exit 130 saying so, in plain writes: the interrupt may have cut an import short, and a library imported
    now (rich's console) could fail on the half-made module (`cli.gone`)."""
    gone()


def _terminate_like_interrupt() -> None:
    """SIGTERM (a scheduler's stop, `kill`) ends a command as Ctrl-C does: exit 130 with nothing saved, the temporary
    files of an unfinished write removed — instead of the bare 143 of a process killed mid-write. A training run
    replaces this with its own handler while it trains (it saves a checkpoint and exits 75)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


class LorakitGroup(TyperGroup):
    """Catches LorakitError from any command (nested groups included) and reports it."""

    def invoke(self, ctx: click.Context):
        use_json(False)
        _terminate_like_interrupt()
        if _STOP["asked"]:  # a SIGTERM whose interrupt Python swallowed before the command began
            _interrupted(ctx)
        try:
            return super().invoke(ctx)
        except _USAGE as e:  # a mistyped command or option, a missing argument: bad input (exit 2), with help
            if _debug() or type(e).__name__ == "NoArgsIsHelpError":  # a bare group: its help, as click shows it
                raise
            ctx.exit(report_error(usage_error(e), json_requested() or "--json" in sys.argv))
        except _CLICK_EXITS:
            raise
        except KeyboardInterrupt:
            _interrupted(ctx)
        except Exception as e:  # noqa: BLE001 - the one place errors become messages
            if _debug():
                raise
            if _STOP["asked"]:  # e.g. an import the signal cut short failing later (RecursionError seen under load)
                _interrupted(ctx)
            ctx.exit(report_error(e, json_requested()))


app = typer.Typer(
    name="lorakit",
    cls=LorakitGroup,
    help="Train LoRAs for FLUX.1-dev, Qwen-Image(-Edit) and Kandinsky 5 on the machine you own.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lorakit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    """Train LoRAs for FLUX.1-dev, Qwen-Image(-Edit) and Kandinsky 5 on the machine you own."""


app.command("doctor", help=doctor.HELP, short_help="is this machine ready? which profile? which kernels work?")(
    doctor.doctor)
app.command("cache", help=cache.HELP, short_help="dataset -> text embeddings + latents on disk")(cache.cache)
app.command("train", help=train.HELP, short_help="cached dataset -> LoRA checkpoints, samples, metrics")(
    train.train)
app.add_typer(convert.app, name="convert", help=convert.HELP,
              short_help="LoRA formats, legacy caches, model files")
app.add_typer(bench.app, name="bench", help=bench.HELP, short_help="measured loading and training speed")
app.command("infer", help=infer.HELP, short_help="base model + LoRA(s) -> images")(infer.infer)
app.command("push", help=push.HELP, short_help="a finished run -> a Hub-ready folder, uploaded when online")(
    push.push)
app.command("ui", help=ui.HELP, short_help="a local web dashboard of the runs (lorakit[ui])")(ui.ui)
app.command("demo", help=demo.HELP, short_help="the whole path on tiny offline models, no downloads")(demo.demo)


def main() -> None:
    """The CLI (`cli.entry.main` runs it, after making SIGTERM an interrupt)."""
    try:
        app()
    except KeyboardInterrupt:  # before or after a command ran
        gone()
    except SystemExit as e:  # typer turns an interrupt while the options are parsed into a bare exit 130
        if e.code == 130 and _STOP["asked"]:
            gone()
        raise
    except LorakitError as e:  # raised outside a command (e.g. while parsing)
        if _debug():
            raise
        sys.exit(report_error(e, "--json" in sys.argv))

"""Helpers every command shares: --json output, config options, the console."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

# not a terminal (a log file, a scheduler): lines as long as they are, never cut to 80 columns
console = Console(highlight=False, width=None if sys.stdout.isatty() else 400)
err_console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 400)

JsonOpt = typer.Option(False, "--json", help="print machine-readable JSON instead of tables")
SetOpt = typer.Option(None, "--set", "-s", help="override a config value: --set lora.rank=32 (repeatable)")
LogFormatOpt = typer.Option("auto", "--log-format", help="progress as a terminal bar (rich), one plain line per "
                            "phase and every 10 s (plain), or JSON lines (json); auto: rich in a terminal, plain "
                            "otherwise (a log file, a scheduler)")
ProfileOpt = typer.Option(None, "--profile", "-p", help="hardware profile: auto, dgx-spark, rtx4090, rtx5090, "
                          "datacenter, cpu (default: the config's, else auto)")


_json_requested: ContextVar[bool] = ContextVar("lorakit_json", default=False)


def use_json(flag: bool) -> bool:
    """Record --json for the error handler (errors then print as JSON too) and return it."""
    _json_requested.set(flag)
    return flag


def json_requested() -> bool:
    return _json_requested.get()


def emit(as_json: bool, data: Any, render: Callable[[], None] | None = None) -> None:
    """Print `data` as JSON, or call `render` for people."""
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=_json_default) + "\n")
    elif render is not None:
        render()


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def resolve_config(config: Path | None, sets: list[str] | None, profile: str | None, **kw):
    """Config file + --set + --profile -> the run's resolved config (`lorakit.plan.resolve.Resolved`); `kw`:
    resolve's options (paths, train, world)."""
    from lorakit.plan.resolve import resolve

    return resolve(config, sets or [], profile, **kw)


def leave_out_unused(cfg, training: bool = True) -> None:
    """bitsandbytes stays out of this process unless the run uses it (`lorakit.unused`): what `lorakit train` and
    `cache` pass as resolve's `settled`, called before anything imports the model libraries. Caching never uses
    it; either uses it for a model whose components were saved quantized by it."""
    from lorakit.plan.memory import needs_bitsandbytes
    from lorakit.unused import leave_out_bitsandbytes

    leave_out_bitsandbytes(training and needs_bitsandbytes(cfg), cfg.model.path)


def print_resolved(r) -> None:
    """Human view of a resolved config (what --dry-run shows): the profile, the config the run will use, the
    memory estimate and what the plan decided."""
    from rich.syntax import Syntax

    from lorakit.config import dump_yaml

    console.print(f"[bold]profile:[/] {r.profile['profile']} — {r.profile['reason']}")
    for w in r.profile.get("warnings", []):
        console.print(f"[yellow]warning:[/] {w}")
    console.print(Syntax(dump_yaml(r.cfg), "yaml", theme="ansi_dark", background_color="default", word_wrap=True))
    console.print(f"[bold]runs on:[/] {r.device}" + (f" x {r.world} processes" if r.world > 1 else ""))
    if r.step:
        console.print(f"[bold]the step:[/] {r.step}", soft_wrap=True)
    if r.estimate:
        parts = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in r.estimate["parts"].items())
        console.print(f"[bold]memory estimate:[/] {r.estimate['gib']} GiB ({parts}; {r.estimate['tokens']} tokens"
                      f"{', blocks uncompiled' if r.estimate.get('uncompiled') else ''}, from {r.estimate['source']})",
                      soft_wrap=True)
    if r.memory_note:
        console.print(f"[bold]memory plan:[/] {r.memory_note}", soft_wrap=True)
    for n in r.notes:
        console.print(f"[yellow]note:[/] {n}", soft_wrap=True)

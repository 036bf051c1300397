"""`lorakit demo`."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import JsonOpt, console, emit, use_json
from lorakit.models.registry import family_names

HELP = """Run the whole path on tiny offline models (no downloads, any laptop).

Builds a tiny random pipeline of the family and a procedurally drawn dataset, checks the machine,
resolves a config and renders samples; everything lands in OUT (a report folder)."""


def demo(
    out: Path = typer.Option(Path("demo-out"), "--out", "-o", help="report folder"),
    family: str = typer.Option(family_names()[0], "--family", "-f",
                               help="model family of the tiny pipeline: " + ", ".join(family_names())),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = JsonOpt,
) -> None:
    use_json(as_json)
    from lorakit.demo import run_demo

    if as_json:
        result = run_demo(out, family, seed)
    else:
        with console.status("demo") as status:
            result = run_demo(out, family, seed, progress=lambda s: status.update(f"demo: {s}..."))
    emit(as_json, result.to_dict(), lambda: _render(result))


def _render(result) -> None:
    from rich.table import Table

    t = Table(title=f"lorakit demo ({result.family})", title_justify="left")
    t.add_column("stage", style="bold")
    t.add_column("s", justify="right")
    t.add_column("result")
    for s in result.stages:
        t.add_row(s.name, f"{s.seconds:.1f}", s.detail)
    console.print(t)
    console.print(f"report folder: {result.out_dir}")

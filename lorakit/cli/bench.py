"""`lorakit bench load|step`."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import JsonOpt, ProfileOpt, use_json
from lorakit.cli.pending import not_in_this_build

HELP = "Measure loading and training speed, side by side with the usual way, in the same run."

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None)


@app.command("load", help="Compare weight-loading backends (cold/warm page cache, CPU/GPU).")
def load(path: Path | None = typer.Argument(None, help="a .safetensors file or folder"),
         synthetic: str | None = typer.Option(None, "--synthetic", help="make a test file of this size, e.g. 8G"),
         as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    raise not_in_this_build("`lorakit bench load`", 4, "see ../shared/BASELINES.md for measured baselines")


@app.command("step", help="Time lorakit's training step against plain diffusers + peft.")
def step(family: str = typer.Option("flux", "--family"), res: int = typer.Option(1024, "--res"),
         steps: int = typer.Option(10, "--steps"), profile: str | None = ProfileOpt,
         as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    raise not_in_this_build("`lorakit bench step`", 8, "see ../shared/BASELINES.md for measured baselines")

"""`lorakit convert lora|cache|model|merge`."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import JsonOpt, use_json
from lorakit.cli.pending import not_in_this_build

HELP = "Convert LoRA formats (diffusers/peft/kohya/ComfyUI), legacy .pt caches and model files."

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None)


@app.command("lora", help="Convert a LoRA between diffusers, peft, kohya and ComfyUI key layouts.")
def lora(src: Path = typer.Argument(..., show_default=False), dst: Path = typer.Argument(..., show_default=False),
         to: str = typer.Option("diffusers", "--to", help="diffusers | peft | kohya | comfyui"),
         as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    raise not_in_this_build("`lorakit convert lora`", 7, "train writes diffusers-format LoRAs")


@app.command("cache", help="Migrate a legacy .pt cache (read with weights_only=True) to lorakit's store.")
def cache(src: Path = typer.Argument(..., show_default=False), as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    raise not_in_this_build("`lorakit convert cache`", 7, "rebuild the cache with `lorakit cache`")


@app.command("model", help="Diffusers folder <-> single file, dtype casts, resharding.")
def model(src: Path = typer.Argument(..., show_default=False), dst: Path = typer.Argument(..., show_default=False),
          as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    raise not_in_this_build("`lorakit convert model`", 7, "diffusers' save_pretrained reshards folders")


@app.command("merge", help="Bake a LoRA into the base weights at a scale.")
def merge(model_dir: Path = typer.Argument(..., show_default=False),
          lora_file: Path = typer.Argument(..., show_default=False),
          dst: Path = typer.Argument(..., show_default=False), scale: float = typer.Option(1.0, "--scale"),
          as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    raise not_in_this_build("`lorakit convert merge`", 7, "diffusers' pipe.fuse_lora() merges in memory")

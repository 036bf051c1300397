"""`lorakit infer`."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import JsonOpt, ProfileOpt, use_json
from lorakit.cli.pending import not_in_this_build

HELP = """Generate images (or a clip) with a base model and LoRAs.

Example: lorakit infer ./FLUX.1-dev --lora out/lora.safetensors:0.8 -p "a red circle" --seed 1"""


def infer(
    model: Path = typer.Argument(..., help="diffusers model folder or single-file checkpoint", show_default=False),
    lora: list[str] | None = typer.Option(None, "--lora", "-l", help="LoRA file, optionally :scale (repeatable)"),
    prompt: list[str] | None = typer.Option(None, "--prompt", "-p", help="prompt (repeatable)"),
    prompts_file: Path | None = typer.Option(None, "--prompts", help="file with one prompt per line"),
    image: list[Path] | None = typer.Option(None, "--image", help="control image(s) for edit families"),
    seed: int = typer.Option(0, "--seed"),
    steps: int = typer.Option(28, "--steps"),
    out: Path = typer.Option(Path("out"), "--out", "-o"),
    profile: str | None = ProfileOpt,
    as_json: bool = JsonOpt,
) -> None:
    use_json(as_json)
    raise not_in_this_build("`lorakit infer`", 7, "the tiny pipelines load with stock diffusers: "
                            "DiffusionPipeline.from_pretrained(folder)")

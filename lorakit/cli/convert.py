"""`lorakit convert lora|cache|model|merge`."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import JsonOpt, console, emit, use_json

HELP = "Convert LoRA formats (diffusers/peft/kohya/ComfyUI), legacy .pt caches and model files."

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None)


@app.command("lora", help="Convert a LoRA between diffusers, peft, kohya and ComfyUI key layouts (exactly).")
def lora(src: Path = typer.Argument(..., show_default=False, help="LoRA file (.safetensors) or peft folder"),
         dst: Path = typer.Argument(..., show_default=False, help="output file (peft: a folder)"),
         to: str = typer.Option("diffusers", "--to", help="diffusers | peft | kohya | comfyui"),
         family: str | None = typer.Option(None, "--family", help="the model family or architecture, when the keys "
                                           "cannot tell (e.g. an attention-only LoRA going to kohya/ComfyUI)"),
         dtype: str | None = typer.Option(None, "--dtype", help="fp32 | bf16 | fp16 (default: as stored)"),
         as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    from lorakit.errors import InputError

    if to not in ("diffusers", "peft", "kohya", "comfyui"):
        raise InputError(f"--to must be one of diffusers, peft, kohya, comfyui; got {to!r}")
    if dtype is not None and dtype not in ("fp32", "bf16", "fp16"):
        raise InputError(f"--dtype must be one of fp32, bf16, fp16, got {dtype!r}")
    if src.exists() and dst.exists() and src.resolve() == dst.resolve():
        raise InputError(f"{dst} would overwrite its input", "name another output")
    if not src.exists():
        raise InputError(f"no such file or folder: {src}")
    from lorakit.config import torch_dtype
    from lorakit.convert import lora as L
    from lorakit.models.registry import arch_of

    arch = arch_of(family) if family else None
    pieces, facts = L.read(src, arch=arch)
    out = L.write(pieces, dst, to, arch or facts["arch"], dtype=torch_dtype(dtype) if dtype else None)
    back, out_facts = L.read(out)
    exact, why = L.deltas_equal(pieces, back, rtol=1e-6 if dtype in (None, "fp32") else 1e-2)
    result = {"input": {"path": str(src), **facts}, "output": {"path": str(out), **out_facts},
              "deltas_equal": exact, "check": why}
    emit(as_json, result, lambda: console.print(
        f"{src} ({facts['format']}, {facts['arch'] or 'architecture unknown'}, {facts['modules']} modules, "
        f"rank {'/'.join(map(str, facts['ranks']))}) -> {out} ({to}); deltas "
        + ("equal" if exact else f"DIFFER: {why}")))
    if not exact:
        raise typer.Exit(1)


@app.command("cache", help="Migrate a legacy .pt cache (read with weights_only=True) to lorakit's store.")
def cache(src: Path = typer.Argument(..., show_default=False, help="folder of .pt files (one per item)"),
          dst: Path | None = typer.Option(None, "--out", help="store folder (default: SRC/lorakit-cache)"),
          family: str | None = typer.Option(None, "--family", help="record the model family in the manifest"),
          as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    from lorakit.convert.cache import migrate

    result = migrate(src, dst, family)
    emit(as_json, result, lambda: console.print(
        f"{result['items']} items from {result['input']} -> {result['output']} ({', '.join(result['tensors'])})"))


@app.command("model", help="Component weights: folder <-> single file, dtype cast (fp8: per-tensor scales), "
                          "resharding with index.json.")
def model(src: Path = typer.Argument(..., show_default=False, help="component folder (e.g. .../transformer) or file"),
          dst: Path = typer.Argument(..., show_default=False, help="NAME.safetensors (one file) or a new folder"),
          dtype: str = typer.Option("keep", "--dtype", help="keep | fp32 | bf16 | fp16 | fp8"),
          shard_gb: float | None = typer.Option(None, "--shard-gb", help="folder output: max shard size (GiB, "
                                                "default 5)"),
          as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    from lorakit.convert.model import convert_model

    result = convert_model(src, dst, dtype, shard_gb)
    emit(as_json, result, lambda: console.print(
        f"{result['input']} -> {result['output']} ({result['tensors']} tensors, {result['bytes'] / 2**30:.2f} GiB, "
        f"dtype {dtype}, {len(result['files'])} file(s))"))


@app.command("merge", help="Bake a LoRA into the base weights at a scale (a new model folder).")
def merge(model_dir: Path = typer.Argument(..., show_default=False, help="diffusers model folder"),
          lora_file: Path = typer.Argument(..., show_default=False, help="LoRA (any layout)"),
          dst: Path = typer.Argument(..., show_default=False, help="new folder for the merged model"),
          scale: float = typer.Option(1.0, "--scale"), as_json: bool = JsonOpt) -> None:
    use_json(as_json)
    from lorakit.convert.merge import merge as do_merge

    result = do_merge(model_dir, lora_file, dst, scale)
    emit(as_json, result, lambda: console.print(
        f"{result['lora']} ({result['lora_format']}, {result['modules']} modules) x {scale} baked into "
        f"{result['model']} -> {result['output']}"))

"""`lorakit convert lora|cache|model|merge`."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import JsonOpt, console, emit, use_json

HELP = "Convert LoRA formats (diffusers/peft/kohya/ComfyUI), legacy .pt caches and model files."

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None)


def _start(as_json: bool) -> None:
    """Each command's first call, after its options parsed (a mistyped option is said at once, without importing
    diffusers: 0.4 s instead of 6.7, CPU 2026-11-27): JSON or not, and the libraries' own notices off the console
    before a conversion imports them (bitsandbytes' optional CPU kernel note on every command)."""
    from lorakit.quiet import quiet_libraries

    use_json(as_json)
    quiet_libraries()


@app.command("lora", help="Convert a LoRA between diffusers, peft, kohya and ComfyUI layouts (exactly; every key of "
                          "the input is converted or listed).")
def lora(src: Path = typer.Argument(..., show_default=False, help="LoRA file (.safetensors) or peft folder"),
         dst: Path = typer.Argument(..., show_default=False, help="output file (peft: a folder)"),
         to: str = typer.Option("diffusers", "--to", help="diffusers | peft | kohya | comfyui"),
         family: str | None = typer.Option(None, "--family", help="the model family or architecture, when the keys "
                                           "cannot tell (e.g. an attention-only LoRA going to kohya/ComfyUI)"),
         model: Path | None = typer.Option(None, "--model", help="the base model folder: needed for DoRA between "
                                           "the peft and ComfyUI conventions (they depend on the base weights)"),
         strict: bool = typer.Option(False, "--strict", help="fail when any key of the input cannot be converted"),
         dtype: str | None = typer.Option(None, "--dtype", help="fp32 | bf16 | fp16 (default: as stored)"),
         as_json: bool = JsonOpt) -> None:
    _start(as_json)
    from lorakit.errors import InputError

    if to not in ("diffusers", "peft", "kohya", "comfyui"):
        raise InputError(f"--to must be one of diffusers, peft, kohya, comfyui; got {to!r}")
    if dtype is not None and dtype not in ("fp32", "bf16", "fp16"):
        raise InputError(f"--dtype must be one of fp32, bf16, fp16, got {dtype!r}")
    from lorakit.convert.run import FAILED, convert_lora

    result = convert_lora(src, dst, to, family, model, strict, dtype)
    emit(as_json, result, lambda: _render_lora(src, Path(result["output"]["path"]), to, result))
    if not result["equal"]:
        raise typer.Exit(FAILED)


def _render_lora(src: Path, out: Path, to: str, r: dict) -> None:
    f = r["input"]
    kinds = "+".join(f["kinds"])
    ranks = "/".join(map(str, f["ranks"])) or "-"
    head = (f"{src} ({f['format']}, {f['arch'] or 'architecture unknown'}, {f['modules']} modules, {kinds}, "
            f"rank {ranks}) -> {out} ({to})")
    n = len(r["not_converted"])
    if not r["equal"]:
        console.print(f"{head}; it reads back otherwise: {r['check']} — the output was not kept", markup=False)
    elif n:
        console.print(f"{head}; {r['check']} for the {r['compared']} converted modules and biases; {n} key(s) "
                      "NOT converted:", markup=False)
        for item in r["not_converted"][:20]:
            console.print(f"  - {item['key']}: {item['why']}", markup=False)
        if n > 20:
            console.print(f"  ... and {n - 20} more (--json lists them all)")
    else:
        console.print(f"{head}; {r['check']}: all {f['keys']} keys converted, {r['compared']} modules and biases "
                      "compared", markup=False)


@app.command("cache", help="Migrate a legacy .pt cache (read with weights_only=True) to lorakit's store.")
def cache(src: Path = typer.Argument(..., show_default=False, help="folder of .pt files (one per item)"),
          dst: Path | None = typer.Option(None, "--out", help="store folder (default: SRC/lorakit-cache)"),
          family: str | None = typer.Option(None, "--family", help="record the model family in the manifest"),
          as_json: bool = JsonOpt) -> None:
    _start(as_json)
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
    _start(as_json)
    from lorakit.convert.model import convert_model

    result = convert_model(src, dst, dtype, shard_gb)
    emit(as_json, result, lambda: console.print(
        f"{result['input']} -> {result['output']} ({result['tensors']} tensors, {result['bytes'] / 2**30:.2f} GiB, "
        f"dtype {dtype}, {len(result['files'])} file(s))"))


@app.command("checkpoint", help="A full fine-tune's sharded checkpoint (dcp/) -> a transformer folder in diffusers "
                               "layout, in one process (any machine, any process count it was written with).")
def checkpoint(ck: Path = typer.Argument(..., show_default=False, help="checkpoint folder, e.g. "
                                         "OUT/checkpoints/step-000500"),
               dst: Path = typer.Argument(..., show_default=False, help="new transformer folder"),
               as_json: bool = JsonOpt) -> None:
    _start(as_json)
    from lorakit.convert.checkpoint import export_checkpoint

    result = export_checkpoint(ck, dst)
    emit(as_json, result, lambda: console.print(
        f"{result['checkpoint']} -> {result['output']} ({result['tensors']} tensors, "
        f"{result['bytes'] / 2**30:.2f} GiB, diffusers layout)"))


@app.command("merge", help="Bake a LoRA into the base weights at a scale (a new model folder).")
def merge(model_dir: Path = typer.Argument(..., show_default=False, help="diffusers model folder"),
          lora_file: Path = typer.Argument(..., show_default=False, help="LoRA (any layout)"),
          dst: Path = typer.Argument(..., show_default=False, help="new folder for the merged model"),
          scale: float = typer.Option(1.0, "--scale"), as_json: bool = JsonOpt) -> None:
    _start(as_json)
    from lorakit.convert.merge import merge as do_merge

    result = do_merge(model_dir, lora_file, dst, scale)
    emit(as_json, result, lambda: console.print(
        f"{result['lora']} ({result['lora_format']}, {result['modules']} modules) x {scale} baked into "
        f"{result['model']} -> {result['output']}"))

"""`lorakit infer`."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import JsonOpt, console, emit, err_console, use_json

HELP = """Generate images (or a clip) with a base model and LoRAs.

Example: lorakit infer ./FLUX.1-dev --lora out/lora.safetensors:0.8 -p "a red circle" --seed 1"""


def infer(
    model: Path = typer.Argument(..., help="diffusers model folder, a Hugging Face repo id (org/name[@revision], "
                                 "from the hub's cache; downloaded when online), or a single-file checkpoint "
                                 "(.safetensors) with --base", show_default=False),
    base: str | None = typer.Option(None, "--base", help="with a single-file MODEL: the model it was made from "
                                    "(folder or repo id), whose text encoders, VAE and scheduler go with it"),
    lora: list[str] | None = typer.Option(None, "--lora", "-l", help="LoRA file (any layout), optionally "
                                          "PATH:scale (repeatable)"),
    prompt: list[str] | None = typer.Option(None, "--prompt", "-p", help="prompt (repeatable)"),
    prompts_file: Path | None = typer.Option(None, "--prompts", help="file with one prompt per line"),
    negative: str | None = typer.Option(None, "--negative", help="negative prompt"),
    image: list[Path] | None = typer.Option(None, "--image", help="control image for edit families (repeatable: "
                                            "Qwen-Image-Edit-Plus takes up to 3, in order)"),
    seed: int = typer.Option(0, "--seed", help="seed of the first image; image k uses seed + k"),
    steps: int | None = typer.Option(None, "--steps", min=1, help="sampling steps (default: 28, or the model's own "
                                     "grid where its pipeline sets one: Qwen-Image-2.1's sample_sigmas)"),
    guidance: float | None = typer.Option(None, "--guidance", help="FLUX guidance / Qwen true-CFG scale"),
    width: int | None = typer.Option(None, "--width"),
    height: int | None = typer.Option(None, "--height"),
    batch: int = typer.Option(1, "--batch", min=1, help="images per prompt"),
    frames: int = typer.Option(17, "--frames", help="frames per clip (video families: 4k+1)"),
    fps: float = typer.Option(24.0, "--fps", help="frame rate of the .mp4 and GIF written (video families)"),
    dtype: str | None = typer.Option(None, "--dtype", help="bf16 | fp16 | fp32 (default: bf16 on GPU)"),
    device: str | None = typer.Option(None, "--device", help="cuda[:N] or cpu"),
    offload: str = typer.Option("auto", "--offload", help="auto | none | model | fp8 | group: where the weights "
                                "wait while the GPU works (auto: all on the GPU when they fit the card or "
                                "LORAKIT_MEMORY_CAP_GIB, else each component while it runs, else the same with "
                                "the transformer's blocks in fp8 (close to bf16, not equal), else its blocks "
                                "streamed from CPU memory in bf16)"),
    out: Path = typer.Option(Path("out"), "--out", "-o", help="folder for the images"),
    as_json: bool = JsonOpt,
) -> None:
    use_json(as_json)
    from lorakit.errors import InputError
    from lorakit.infer import Request, generate, parse_lora

    texts = list(prompt or [])
    if prompts_file is not None:
        if not prompts_file.is_file():
            raise InputError(f"--prompts: no such file: {prompts_file}")
        texts += [ln.strip() for ln in prompts_file.read_text().splitlines() if ln.strip()]
    if dtype is not None and dtype not in ("bf16", "fp16", "fp32"):
        raise InputError(f"--dtype must be bf16, fp16 or fp32, got {dtype!r}")
    for side in (width, height):
        if side is not None and side % 16:
            raise InputError(f"--width/--height must be multiples of 16, got {side}")
    loras = [parse_lora(s) for s in (lora or [])]
    from lorakit.placement import MODES

    if offload not in MODES:
        raise InputError(f"--offload {offload!r}: not one of {', '.join(MODES)}")
    req = Request(prompts=texts, seed=seed, steps=steps, guidance=guidance, negative=negative, width=width,
                  height=height, batch=batch, images=list(image or []), frames=frames, fps=fps, offload=offload)
    from lorakit.models.sources import model_folder
    from lorakit.quiet import quiet_libraries

    quiet_libraries(imports=False)
    model, found = model_folder(model, base, keys=("MODEL", "--base"))
    from lorakit.unused import leave_out_bitsandbytes

    leave_out_bitsandbytes(False, model)  # sampling never uses it (`lorakit.unused`)
    quiet_libraries()
    for note in found:
        err_console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    if as_json:  # stdout holds the JSON alone; the phases, time-stamped, on a terminal's stderr (or when asked)
        import os
        import sys
        import time

        t0 = time.perf_counter()
        say = None
        if sys.stderr.isatty() or os.environ.get("LORAKIT_PROGRESS", "") not in ("", "0"):
            def say(msg):
                err_console.print(f"[{time.perf_counter() - t0:6.1f} s] infer: {msg}", markup=False,
                                  highlight=False, soft_wrap=True)
        result = generate(model, req, loras, out, device=device, dtype_name=dtype, progress=say)
    else:
        with console.status("infer") as st:
            result = generate(model, req, loras, out, device=device, dtype_name=dtype,
                              progress=lambda msg: st.update(f"infer: {msg}"))
    emit(as_json, result, lambda: _render(result))


def _render(result: dict) -> None:
    from rich.markup import escape

    for w in result["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}", soft_wrap=True)
    if result.get("sampling"):
        console.print(f"sampling: {result['sampling']}", markup=False, soft_wrap=True)
    console.print("\n".join(result["files"]) + (f"\ncontact sheet: {result['contact_sheet']}" if result["contact_sheet"]
                                                else ""), markup=False)
